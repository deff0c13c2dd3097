"""SkyPilot task files as WhaleZen job specs.

A task file (https://docs.skypilot.co/en/latest/reference/yaml-spec.html) becomes the native spec that
broker/jobs/spec.py validates: `resources.accelerators` in every SkyPilot spelling (alternatives
included), `cpus`/`memory` (`4+` reserves at least 4), `use_spot`, `infra`/`cloud`/`region`/`zone`,
`any_of`/`ordered`, `image_id: docker:...`, `num_nodes`, `envs`/`secrets`, and `setup` + `run` as one
bash command run on every node. Each other field is refused by field, or accepted with a warning
when it does not change a batch run; docs/job-spec.md lists every decision. Nothing is ignored
silently.
"""
from __future__ import annotations

import math
import re
import secrets as token
from typing import Any

from broker.jobs.formats.common import FieldProblem, FormatError, Translation

# Top-level keys that only a SkyPilot task has: their presence says what the document is.
SKYPILOT_ONLY_KEYS = frozenset({"run", "setup", "envs", "secrets", "num_nodes", "workdir", "file_mounts",
                                "service", "config", "volumes", "event_callback", "experimental"})
SKYPILOT_RESOURCE_KEYS = frozenset({"cpus", "memory", "use_spot", "infra", "cloud", "region", "zone", "any_of",
                                    "ordered", "image_id", "disk_size", "disk_tier", "network_tier", "instance_type",
                                    "ports", "labels", "autostop", "job_recovery", "accelerator_args",
                                    "max_hourly_cost", "volumes"})
TOP_LEVEL_KEYS = frozenset({"name", "resources", "whalezen"}) | SKYPILOT_ONLY_KEYS
# Options of ours a task file may carry under `whalezen:` (SkyPilot has no such fields).
WHALEZEN_EXTRAS = frozenset({"priority", "preemptible", "expected_duration_hours", "deadline", "checkpoint",
                             "interconnect"})
CLOUDS = {"aws": "aws", "gcp": "gcp", "onprem": "onprem", "local": "local"}
NOT_YET_CLOUDS = {"k8s", "kubernetes", "ssh", "azure", "lambda", "oci", "runpod", "nebius", "paperspace",
                  "fluidstack", "cudo", "vast", "do", "ibm", "scp", "vsphere", "hyperbolic", "seeweb", "slurm"}
# Fields that do not change what a batch run computes: accepted, and the response says what they mean here.
WARNED_RESOURCE_FIELDS = {
    "disk_size": "Nodes' disks are not sized per job: the job gets the node's disk as it is.",
    "disk_tier": "Disk tiers are not chosen per job.",
    "network_tier": "Multi-node jobs are always placed on nodes with a fast fabric; network_tier is not read.",
    "ports": "Batch jobs open no ports to the outside; ports is not used.",
    "labels": "Instance labels are not set from a task file; ask for node labels with a Kubernetes "
              "nodeSelector or placement.node_selector.",
    "autostop": "WhaleZen releases rented instances itself when no job needs them; autostop is not read.",
    "job_recovery": "WhaleZen requeues a job after a spot interruption or node failure by itself (resuming "
                    "from its last checkpoint when it has whalezen.checkpoint); job_recovery is not read.",
}
WARNED_TOP_FIELDS = {
    "service": "WhaleZen runs batch jobs: the service section (replicas, readiness probe) is not used.",
    "config": "SkyPilot config overrides do not apply to WhaleZen.",
    "event_callback": "Event callbacks are not run; follow GET /api/v1/jobs/{id}/events/ instead.",
    "experimental": "Experimental SkyPilot options are not read.",
}
_LOCATION_KEYS = ("infra", "cloud", "region", "zone")
_MEMORY_UNITS = {"": 1.0, "b": 1 / 2**30, "k": 1 / 2**20, "kb": 1 / 2**20, "m": 1 / 1024, "mb": 1 / 1024,
                 "g": 1.0, "gb": 1.0, "t": 1024.0, "tb": 1024.0}
_NUMBER_PLUS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]{0,2})\s*(\+?)\s*$")
# setup first, on every node; a failed setup ends the job with setup's exit code and says so.
SETUP_THEN_RUN = ('bash -c "$1" || { rc=$?; echo "whalezen: setup failed with exit code $rc" >&2; exit $rc; }\n'
                  'exec bash -c "$2"')
MAX_SCRIPT_CHARS = 8192
WORKDIR_DESTINATION = "~/sky_workdir"  # where SkyPilot syncs a task's workdir, and runs it
UPLOAD_SOURCE = re.compile(r"^upload:[0-9a-f]{32}$")
COPIED_SCHEMES = ("s3://", "gs://")
UPLOADED_BY_CLI = "a local path: submit the task with `whalezen submit`, which uploads it and names the upload here"


def looks_like_skypilot(doc: dict) -> bool:
    """A SkyPilot task: a SkyPilot-only top-level key, or resources spelled SkyPilot's way."""
    if SKYPILOT_ONLY_KEYS & set(doc):
        return True
    resources = doc.get("resources")
    return isinstance(resources, dict) and bool(SKYPILOT_RESOURCE_KEYS & set(resources)) and "command" not in doc


def translate_skypilot(doc: dict) -> Translation:
    out = Translation(spec={"format": "skypilot"})
    errors: dict[str, str] = {}
    unknown = frozenset(str(key) for key in set(doc) - TOP_LEVEL_KEYS)
    for key in sorted(unknown):
        errors[key] = "Not a SkyPilot task field WhaleZen knows (see docs/job-spec.md, SkyPilot task files)."
    for key, message in WARNED_TOP_FIELDS.items():
        if key in doc:
            out.warnings.append(FieldProblem(key, message))

    name = doc.get("name")
    if name is None:
        out.spec["name"] = f"task-{token.token_hex(3)}"
    else:
        out.spec["name"] = name  # the native validator says what a name may hold
    _script_command(doc, out, errors)
    _environment(doc, "envs", "env", out, errors)
    _environment(doc, "secrets", "secrets", out, errors)
    _files(doc, out, errors)
    if doc.get("volumes") not in (None, {}, [], ""):
        errors["volumes"] = "Volumes are not supported: use file_mounts with an s3:// or gs:// source (copied)."
    nodes = doc.get("num_nodes")
    if nodes is not None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            errors["num_nodes"] = "Must be a whole number of nodes, at least 1."
        else:
            out.spec.setdefault("resources", {})["nodes"] = nodes
    resources = doc.get("resources", {})
    if not isinstance(resources, dict):
        errors["resources"] = "Must be a mapping of resource fields."
    else:
        _resources(resources, out, errors)
    _extras(doc.get("whalezen"), out, errors)
    if errors:
        raise FormatError(errors, literal=unknown)
    return out


def _script_command(doc: dict, out: Translation, errors: dict[str, str]) -> None:
    scripts = {}
    for key in ("setup", "run"):
        value = doc.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            errors[key] = "Must be a shell script (a string)."
        elif len(value) > MAX_SCRIPT_CHARS:
            errors[key] = f"At most {MAX_SCRIPT_CHARS} characters."
        elif value.strip():
            scripts[key] = value
    if doc.get("workdir") is not None:  # SkyPilot runs setup and run inside the synced workdir
        scripts = {key: f'cd "$HOME/{WORKDIR_DESTINATION[2:]}" || exit 1\n{script}' for key, script in scripts.items()}
    if "run" not in scripts:
        if "setup" in scripts:
            errors["run"] = "A task with setup needs a run script: WhaleZen runs jobs, it does not keep clusters."
        return  # an image_id without run runs the image's own entrypoint; resources says if neither is there
    if "setup" in scripts:
        out.spec["command"] = ["/bin/bash", "-c", SETUP_THEN_RUN, "whalezen-task", scripts["setup"], scripts["run"]]
    else:
        out.spec["command"] = ["/bin/bash", "-c", scripts["run"]]


def _files(doc: dict, out: Translation, errors: dict[str, str]) -> None:
    """`workdir` and `file_mounts` as native `files`: uploads (what `whalezen submit` sent of local
    folders) and s3:// / gs:// objects, copied onto every node before setup."""
    files: list[dict[str, str]] = []
    workdir = doc.get("workdir")
    if workdir is not None:
        if not isinstance(workdir, str) or not workdir.strip():
            errors["workdir"] = "Must be a path (a local folder) or an upload:<id>."
        elif UPLOAD_SOURCE.match(workdir.strip()):
            files.append({"source": workdir.strip(), "destination": WORKDIR_DESTINATION})
        else:
            out.problems.append(FieldProblem("workdir", f"{workdir[:80]!r} is {UPLOADED_BY_CLI}."))
    mounts = doc.get("file_mounts")
    if mounts is not None and not isinstance(mounts, dict):
        errors["file_mounts"] = "Must be a mapping of destination path: source."
        mounts = None
    for destination, source in (mounts or {}).items():
        field = f"file_mounts[{destination}]"  # brackets: a destination holds dots and slashes
        if not isinstance(destination, str) or not destination.strip():
            errors["file_mounts"] = "Destinations must be paths."
            continue
        if isinstance(source, dict):
            unknown = sorted(set(source) - {"source", "mode", "name", "store", "persistent"}, key=str)
            if unknown:
                errors[field] = f"Storage fields here: source, mode, name, store, persistent; not {unknown[0]!r}."
                continue
            mode = str(source.get("mode") or "COPY").upper()
            if mode != "COPY":
                out.problems.append(FieldProblem(f"{field}.mode", f"Mode {mode[:20]} is not supported: only COPY "
                                                                  "(copied onto the node before setup; nothing is "
                                                                  "written back)."))
                continue
            if source.get("source") is None:
                errors[field] = "Creating a bucket is not supported: give the source of existing data."
                continue
            if source.get("persistent") is False or source.get("store") or source.get("name"):
                out.warnings.append(FieldProblem(field, "Only the source is read: the data is copied, never "
                                                        "stored into a bucket WhaleZen creates."))
            source = source["source"]
        if isinstance(source, list):
            errors[field] = "One source per destination."
            continue
        if not isinstance(source, str) or not source.strip():
            errors[field] = "Must be an s3:// or gs:// URI, a local path (uploaded by whalezen submit), or upload:<id>."
            continue
        source = source.strip()
        if source.startswith(COPIED_SCHEMES) or UPLOAD_SOURCE.match(source):
            files.append({"source": source, "destination": destination.strip()})
        elif re.match(r"^[a-z][a-z0-9+.-]*://", source):
            errors[field] = (f"Sources WhaleZen copies: s3://, gs://, and local paths (uploaded by whalezen "
                             f"submit); not {source.split('://')[0][:20]}://.")
        else:
            out.problems.append(FieldProblem(field, f"{source[:80]!r} is {UPLOADED_BY_CLI}."))
    if files:
        out.spec["files"] = files


def _environment(doc: dict, key: str, native: str, out: Translation, errors: dict[str, str]) -> None:
    values = doc.get(key)
    if values is None:
        return
    if not isinstance(values, dict):
        errors[key] = "Must be a mapping of NAME: value."
        return
    env: dict[Any, str] = {}
    for name, value in values.items():
        if value is None:
            out.problems.append(FieldProblem(f"{key}.{name}", "Must be supplied at submit time "
                                                               f"(whalezen submit --env {name}=VALUE)."))
        elif isinstance(value, (str, int, float, bool)):
            env[name] = str(value)
        else:
            errors[f"{key}.{name}"] = "Must be a string, a number, a boolean, or null (supplied at submit time)."
    if env:
        out.spec[native] = env


def _extras(extras: Any, out: Translation, errors: dict[str, str]) -> None:
    if extras is None:
        return
    if not isinstance(extras, dict):
        errors["whalezen"] = "Must be a mapping of WhaleZen job options."
        return
    for key, value in extras.items():
        if key not in WHALEZEN_EXTRAS:
            errors[f"whalezen.{key}"] = f"Options here: {', '.join(sorted(WHALEZEN_EXTRAS))}."
        elif key == "interconnect":
            out.spec.setdefault("resources", {})["interconnect"] = value
        else:
            out.spec[key] = value


# -- resources ---------------------------------------------------------------------------------------

def _resources(resources: dict, out: Translation, errors: dict[str, str]) -> None:
    known = SKYPILOT_RESOURCE_KEYS | {"accelerators"}
    for key in sorted(set(resources) - known, key=str):
        errors[f"resources.{key}"] = "Not a SkyPilot resources field WhaleZen knows."
    for key, message in WARNED_RESOURCE_FIELDS.items():
        if key in resources:
            out.warnings.append(FieldProblem(f"resources.{key}", message))
    for key, message in (("instance_type", "Ask for accelerators (and cpus/memory) instead: WhaleZen picks the "
                                           "instance type, or an owned node, itself."),
                         ("accelerator_args", "TPUs and accelerator arguments are not supported."),
                         ("volumes", "Volumes are not supported yet.")):
        if key in resources:
            errors[f"resources.{key}"] = message
    choices = [resources]
    for key in ("any_of", "ordered"):
        if key not in resources:
            continue
        listed = resources[key]
        if not isinstance(listed, list) or not listed or not all(isinstance(item, dict) for item in listed):
            errors[f"resources.{key}"] = "Must be a non-empty list of resource mappings."
            return
        if "any_of" in resources and "ordered" in resources:
            errors["resources.ordered"] = "Give any_of or ordered, not both."
            return
        base = {k: v for k, v in resources.items() if k not in ("any_of", "ordered")}
        choices = [{**base, **item} for item in listed]
        for i, item in enumerate(listed):
            for nested in sorted(set(item) & {"any_of", "ordered"}):
                errors[f"resources.{key}[{i}].{nested}"] = "Alternatives cannot nest."
        if key == "ordered":
            out.warnings.append(FieldProblem("resources.ordered", "Taken as any_of: WhaleZen places the job on "
                                                                  "the cheapest feasible choice, not the first listed."))
        field_prefix = f"resources.{key}"
        break
    else:
        field_prefix = "resources"
    parsed = []
    for i, choice in enumerate(choices):
        where = field_prefix if len(choices) == 1 and field_prefix == "resources" else f"{field_prefix}[{i}]"
        parsed.append(_one_choice(choice, where, out, errors))
    if errors:
        return
    _merge_choices(parsed, field_prefix, out, errors)


def _one_choice(choice: dict, where: str, out: Translation, errors: dict[str, str]) -> dict[str, Any]:
    """One resource choice as {accelerators, location, rest}: what may differ between alternatives."""
    accelerators = choice.get("accelerators")
    if isinstance(accelerators, list) and len(accelerators) > 1:
        out.warnings.append(FieldProblem(f"{where}.accelerators", "A list is taken as a set: WhaleZen places the "
                                                                  "job on the cheapest feasible model, not the first."))
    rest: dict[str, Any] = {}
    if "cpus" in choice:
        cpus = _number_plus(choice["cpus"], f"{where}.cpus", errors, unit=False)
        if cpus is not None:
            rest["cpu"] = cpus
    if "memory" in choice:
        memory = choice["memory"]
        if isinstance(memory, str) and memory.strip().lower().endswith("x"):
            ratio = _number_plus(memory.strip()[:-1], f"{where}.memory", errors, unit=False)
            if ratio is not None and "cpu" not in rest:
                errors[f"{where}.memory"] = 'The "<N>x" form (GB per vCPU) needs cpus.'
            elif ratio is not None:
                rest["memory_gb"] = ratio * rest["cpu"]
        else:
            gigabytes = _number_plus(memory, f"{where}.memory", errors, unit=True)
            if gigabytes is not None:
                rest["memory_gb"] = gigabytes
    if "use_spot" in choice:
        if not isinstance(choice["use_spot"], bool):
            errors[f"{where}.use_spot"] = "Must be true or false."
        else:
            rest["spot"] = "required" if choice["use_spot"] else "never"
    if "max_hourly_cost" in choice:
        rest["max_price_per_hour"] = choice["max_hourly_cost"]
    if "image_id" in choice:
        image = choice["image_id"]
        if not isinstance(image, str) or not image.startswith("docker:") or not image[len("docker:"):].strip():
            errors[f"{where}.image_id"] = ('Only container images are supported: "docker:<image>", e.g. '
                                           '"docker:nvcr.io/nvidia/pytorch:24.05-py3" (not machine images or '
                                           'per-region mappings).')
        else:
            rest["image"] = image[len("docker:"):].strip()
    return {"accelerators": accelerators, "location": _location(choice, where, out, errors), "rest": rest}


def _number_plus(value: Any, field: str, errors: dict[str, str], *, unit: bool) -> float | None:
    """SkyPilot's `4`, `4+`, `32GB+`: the amount the job reserves (a `+` minimum reserves that much)."""
    if isinstance(value, bool):
        errors[field] = "Must be a number such as 8 or 8+."
        return None
    if isinstance(value, (int, float)):
        amount, suffix = float(value), ""
    elif isinstance(value, str) and (match := _NUMBER_PLUS.match(value)):
        amount, suffix = float(match.group(1)), match.group(2).lower()
    else:
        errors[field] = 'Must be a number such as 8 or "8+"' + (' (GB; units KB, MB, GB, TB).' if unit else ".")
        return None
    if suffix and (not unit or suffix not in _MEMORY_UNITS):
        errors[field] = "Units KB, MB, GB or TB only." if unit else "Must be a number of CPUs such as 8 or 8+."
        return None
    amount *= _MEMORY_UNITS[suffix] if unit else 1.0
    if not math.isfinite(amount) or amount <= 0:
        errors[field] = "Must be more than 0."
        return None
    return amount


def _location(choice: dict, where: str, out: Translation, errors: dict[str, str]) -> tuple[str, str]:
    """(provider, region) from `infra` ("aws/us-east-1/us-east-1a", "*/us-east-1") or cloud/region/zone."""
    if "infra" in choice and any(k in choice for k in ("cloud", "region", "zone")):
        errors[f"{where}.infra"] = "Give infra, or cloud/region/zone, not both."
        return "", ""
    if "infra" in choice:
        infra = choice["infra"]
        if not isinstance(infra, str) or not infra.strip():
            errors[f"{where}.infra"] = 'Must look like "aws", "gcp/us-central1" or "aws/us-east-1/us-east-1a".'
            return "", ""
        parts = [part.strip() for part in infra.strip().split("/")]
        cloud, region, zone = (parts + ["", "", ""])[:3]
        field = f"{where}.infra"
        if len(parts) > 3:
            errors[field] = 'Must look like "aws", "gcp/us-central1" or "aws/us-east-1/us-east-1a".'
            return "", ""
    else:
        cloud, region, zone = (choice.get(k) or "" for k in ("cloud", "region", "zone"))
        for key, value in (("cloud", cloud), ("region", region), ("zone", zone)):
            if not isinstance(value, str):
                errors[f"{where}.{key}"] = "Must be a string."
                return "", ""
        field = f"{where}.cloud"
    provider = ""
    if cloud and cloud != "*":
        provider = CLOUDS.get(cloud.lower(), "")
        if not provider:
            later = " (Kubernetes clusters are not a place to run yet)" if cloud.lower() in ("k8s", "kubernetes") else ""
            errors[field] = (f"WhaleZen places jobs on {', '.join(CLOUDS)}; not on {cloud[:40]!r}{later}. "
                             "Leave it out to let WhaleZen choose.")
            return "", ""
    if zone and not region:
        region = _region_of_zone(zone)
    if zone:
        out.warnings.append(FieldProblem(f"{where}.{'infra' if 'infra' in choice else 'zone'}",
                                         f"Zones are not pinned: the job may run anywhere in region {region}."))
    return provider, region


def _region_of_zone(zone: str) -> str:
    # AWS us-east-1a -> us-east-1; GCP us-central1-a -> us-central1.
    if re.fullmatch(r"[a-z]+(-[a-z]+)+\d-[a-z]", zone):
        return zone.rsplit("-", 1)[0]
    return zone[:-1] if zone[-1:].isalpha() else zone


def _merge_choices(parsed: list[dict], prefix: str, out: Translation, errors: dict[str, str]) -> None:
    """Alternatives become one demand: GPU models (each with its count) and places any of which will
    do. They may differ in accelerators or in location, not in anything else, and not in both unless
    every combination was listed: otherwise the job could land on a pairing the user did not ask for."""
    first = parsed[0]
    for i, choice in enumerate(parsed[1:], start=1):
        for key in sorted(set(first["rest"]) | set(choice["rest"])):
            if first["rest"].get(key) != choice["rest"].get(key):
                errors[f"{prefix}[{i}]"] = (f"Alternatives may differ in accelerators or location only, not in "
                                            f"{_skypilot_name(key)}.")
                return
    pairs = {(_accelerator_key(c["accelerators"]), c["location"]) for c in parsed}
    accelerator_sets = {a for a, _ in pairs}
    locations = {loc for _, loc in pairs}
    if len(pairs) != len(accelerator_sets) * len(locations):
        errors[prefix] = ("Alternatives that differ in both accelerators and location must list every "
                          "combination; WhaleZen places one demand over any of the models in any of the places.")
        return
    providers = sorted({p for p, _ in locations})
    regions = sorted({r for _, r in locations})
    if locations != {(p, r) for p in providers for r in regions}:
        errors[prefix] = ("Alternatives' locations must pair every listed cloud with every listed region (or "
                          "leave the region out); WhaleZen cannot place on some pairings and not others.")
        return
    resources = out.spec.setdefault("resources", {})
    accelerators = _union_accelerators([c["accelerators"] for c in parsed], prefix, errors)
    if accelerators is None:
        if not errors:
            errors[f"{prefix}.accelerators" if prefix == "resources" else prefix] = (
                "WhaleZen runs GPU jobs: give accelerators, e.g. A100-80GB:1.")
        return
    resources["accelerators"] = accelerators
    rest = dict(first["rest"])
    image = rest.pop("image", None)
    if image:
        out.spec["image"] = image
    for key in ("cpu", "memory_gb"):
        if key in rest:
            resources[key] = rest.pop(key)
    placement = {key: rest[key] for key in ("spot", "max_price_per_hour") if key in rest}
    if providers and "" not in providers:
        placement["providers"] = providers
    if regions and "" not in regions:
        placement["regions"] = regions
    if placement:
        out.spec["placement"] = placement
    if "command" not in out.spec and "image" not in out.spec:
        errors["run"] = "Give a run script (or resources.image_id: docker:<image> to run the image's entrypoint)."


def _accelerator_key(accelerators: Any) -> str:
    return repr(accelerators)


def _union_accelerators(values: list[Any], prefix: str, errors: dict[str, str]) -> list[str] | None:
    """Every alternative's accelerators as one list of "MODEL:COUNT" strings (the native field parses it)."""
    merged: list[str] = []
    for value in values:
        if value is None:
            if len(values) > 1:
                errors[prefix] = "Every alternative needs accelerators."
            return None
        if isinstance(value, str):
            items = [value]
        elif isinstance(value, list):
            items = value
        elif isinstance(value, dict):
            items = [k if v is None else f"{k}:{v}" for k, v in value.items()]
        else:
            items = [value]
        for item in items:
            if not isinstance(item, str):
                errors[f"{prefix}.accelerators"] = 'Must look like "A100-80GB:8", {A100-80GB: 8} or a list of those.'
                return None
            if item not in merged:
                merged.append(item)
    return merged


def _skypilot_name(native_key: str) -> str:
    return {"cpu": "cpus", "memory_gb": "memory", "spot": "use_spot", "max_price_per_hour": "max_hourly_cost",
            "image": "image_id"}.get(native_key, native_key)
