"""From what a user sent to a validated spec: format translation, validation, and the problems that
would block the submission (for a dry run to list, for a real one to refuse).

Every way in (the jobs API, quotes, the console's form and YAML paste) goes through `submission_parse`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from django.core.cache import cache
from rest_framework import serializers

from broker.inventory.models import Gpu
from broker.inventory.selectors import pools_usable_by
from broker.jobs.formats import FieldProblem, FormatError, translate
from broker.jobs.selectors import gpu_catalog
from broker.jobs.spec import Demand, GpuCatalog, JobSpecSerializer
from broker.tenancy.models import Tenant

REACHABLE_CACHE_SECONDS = 15
# A field path's parts: dots separate them, except inside [...] (`file_mounts[~/vocab.txt].mode`).
_PATH_PART = re.compile(r"(?:[^.\[]|\[[^\]]*\])+")  # a new pool or node is seen by submissions within this


@dataclass
class Submission:
    format: str
    validated: dict[str, Any]
    warnings: list[FieldProblem] = field(default_factory=list)
    problems: list[FieldProblem] = field(default_factory=list)

    @property
    def demand(self) -> Demand:
        return self.validated["_demand"]


def submission_parse(data: Any, *, tenant: Tenant, declared: str | None = None,
                     catalog: GpuCatalog | None = None) -> Submission:
    """Translate and validate `data`; raises ValidationError by field (a 400) when it is malformed.

    The returned problems (an env value still to supply, an unsupported mount, a GPU model the team
    cannot reach) do not raise here: a dry run lists them, `submission_refuse_problems` refuses them.
    """
    try:
        fmt, translation = translate(data, declared=declared)
    except FormatError as exc:
        raise serializers.ValidationError(nested_errors(exc.errors, literal=exc.literal)) from None
    native = {k: v for k, v in translation.spec.items() if k != "format"}
    catalog = catalog or gpu_catalog()
    spec = JobSpecSerializer(data=native, context={"gpu_catalog": catalog})
    spec.is_valid(raise_exception=True)
    validated = spec.validated_data
    validated["format"] = fmt
    submission = Submission(format=fmt, validated=validated, warnings=list(translation.warnings),
                            problems=list(translation.problems))
    _check_reach(submission, tenant, catalog)
    _check_uploads(submission, tenant)
    return submission


def submission_refuse_problems(submission: Submission) -> None:
    """A real submission with problems is refused, by field, before anything is written."""
    if submission.problems:
        raise serializers.ValidationError(nested_errors({p.field: p.message for p in submission.problems}))


def nested_errors(flat: dict[str, str], *, literal: frozenset[str] = frozenset()) -> dict[str, Any]:
    """{"resources.cpus": msg} as the API's nested error shape {"resources": {"cpus": [msg]}}, as DRF
    gives for native fields (clients show both as `resources.cpus`). A key in `literal` (a top-level key
    as the user wrote it: `a.b`, `0.`) stays one key."""
    out: dict[str, Any] = {}
    for path, message in flat.items():
        if path in literal:
            out.setdefault(path, []).append(message)
            continue
        parts = _PATH_PART.findall(path) or [path]
        head = re.match(r"^([^\[]+)(\[.*\])$", parts[0])
        if head:  # a top-level key is a request field: `files[0]` -> files, [0]
            parts[:1] = [head.group(1), head.group(2)]
        *parents, leaf = parts
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if isinstance(child, list):  # a message for the parent itself, and one for a field inside
                child = node[part] = {"non_field_errors": child}
            node = child
        if isinstance(node.get(leaf), dict):
            node[leaf].setdefault("non_field_errors", []).append(message)
        else:
            node.setdefault(leaf, []).append(message)
    return out


def reachable_gpu_models(tenant: Tenant) -> tuple[frozenset[str], bool]:
    """GPU models the team can get (on nodes of pools it may use, or sold by its cloud pools), and
    whether that is known for sure: a cloud pool whose offers could not be read now may sell more."""
    key = f"wz:reachable-models:{tenant.pk}"
    cached = cache.get(key)
    if cached is not None:
        return cached
    pools = pools_usable_by(tenant)
    complete = True
    models = set(Gpu.objects.filter(node__pool__in=pools, model__isnull=False)
                 .values_list("model__name", flat=True).distinct())
    from broker.provisioning.offers import CLOUD_KINDS  # provisioning imports jobs: imported late

    cloud_pools = list(pools.filter(enabled=True, max_instances__gt=0, kind__in=CLOUD_KINDS))
    if cloud_pools:
        from broker.provisioning.offers import pool_offer_models

        for pool in cloud_pools:
            sold = pool_offer_models(pool)
            complete = complete and bool(sold)
            models |= sold
    result = (frozenset(models), complete)
    cache.set(key, result, REACHABLE_CACHE_SECONDS)
    return result


def _check_reach(submission: Submission, tenant: Tenant, catalog: GpuCatalog) -> None:
    """A model spelling that names no GPU the team can reach is said at submit time, with what would."""
    demand = submission.demand
    if not demand.gpu_models:
        return
    reachable, complete = reachable_gpu_models(tenant)
    missing = [model for model in demand.gpu_models if model not in reachable]
    if not missing:
        return
    resources = submission.validated["resources"]
    field_name = "resources.accelerators" if "accelerators" in resources else "resources.gpu_models"
    written = _spellings(resources)
    named = ", ".join(_as_written(model, written, catalog) for model in missing)
    hint = (f"This team can reach {', '.join(sorted(reachable))}." if reachable
            else "This team has no pool with GPUs yet.")
    if len(missing) < len(demand.gpu_models) or not complete:
        submission.warnings.append(FieldProblem(field_name, f"No pool of this team has {named}; the job can "
                                                            f"only run on the other models. {hint}"))
        return
    submission.problems.append(FieldProblem(field_name, f"No pool of this team has {named}. {hint}"))


def _check_uploads(submission: Submission, tenant: Tenant) -> None:
    """An `upload:` source must be one of this team's uploads (another team's is as unknown as none)."""
    for number, entry in enumerate(submission.validated.get("files", [])):
        if entry["source"].startswith("upload:"):
            from broker.jobs.uploads import upload_check

            problem = upload_check(tenant, entry["source"][len("upload:"):])
            if problem:
                submission.problems.append(FieldProblem(f"files[{number}].source", problem))


def _spellings(resources: dict[str, Any]) -> list[str]:
    if "accelerators" in resources:
        return [model for model, _ in resources["accelerators"]]
    return list(resources.get("gpu_models", []))


def _as_written(model: str, written: list[str], catalog: GpuCatalog) -> str:
    """`A100` as the user wrote it, with the model it means ("A100" is A100-40GB, SkyPilot's naming)."""
    for spelling in written:
        ref = catalog.resolve(spelling)
        if ref is not None and ref.name == model and spelling.lower() != model.lower():
            return f"{spelling!r} (that is {model}, {ref.memory_gb} GB)"
    return model
