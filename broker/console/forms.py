"""The console's job forms: the submit form, the pasted spec, the migrate target, the jobs filter.

The forms do not validate a job themselves. They turn what the user typed into a spec dict in our own
format (docs/job-spec.md), which the API's `JobSpecSerializer` validates; its errors come back here and
are put next to the field they name (`attach_errors`), in the API's words. So a field the form lets
through and the API refuses reads the same in both, and no rule lives twice.
"""
from __future__ import annotations

import re
import shlex
from typing import Any

from django import forms
from django.conf import settings

from broker.api.errors import shorten
from broker.api.parsers import BodyError, load_json, load_yaml
from broker.jobs.spec import PRIORITY_NAMES
from broker.jobs.states import JobState

_INT = re.compile(r"^[+-]?[0-9]{1,18}$")
_FLOAT = re.compile(r"^[+-]?(?:[0-9]{1,18}(?:\.[0-9]{0,12})?|\.[0-9]{1,12})$")


def _number(text: str) -> Any:
    """A typed number as JSON would carry it (int or float), or the text itself, which the API's
    strict fields then refuse in their own words ("Must be an integer.")."""
    text = text.strip()
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    return text


def _text(**attrs: Any) -> forms.CharField:
    return forms.CharField(required=False, strip=True, widget=forms.TextInput(attrs=attrs))


def _num(step: str = "1", **attrs: Any) -> forms.CharField:
    # A CharField under a number input: Django would refuse "1.5" for an IntegerField in its own words;
    # the API's message is the one users should read.
    return forms.CharField(required=False, strip=True,
                           widget=forms.NumberInput(attrs={"step": step, "inputmode": "decimal", **attrs}))


# Label and hint of each field (the hint names the spec field it fills, for users who also write specs).
FIELD_TEXT: dict[str, tuple[str, str]] = {
    "name": ("Name", "Letters, digits, '.', '_' or '-' (name)."),
    "command": ("Command", "One line, split like a shell does: quote arguments with spaces (command)."),
    "image": ("Container image", "A command, an image, or both (image)."),
    "ask": ("Ask for", "Concrete GPUs per node, or compute units (A100 = 1 CU) and the broker picks the GPUs."),
    "gpus": ("GPUs per node", "1 to 64 (resources.gpus)."),
    "compute_units": ("Compute units", "Used when asking for compute units (resources.compute_units)."),
    "gpu_models": ("GPU models", "Any of the chosen models; none chosen: any model (resources.gpu_models)."),
    "min_gpu_memory_gb": ("Min GPU memory (GB)", "Each GPU has at least this much (resources.min_gpu_memory_gb)."),
    "interconnect": ("Interconnect", "resources.interconnect"),
    "nodes": ("Nodes", "More than one: a gang of nodes, GPUs per node on each (resources.nodes)."),
    "cpu": ("CPU cores per node", "resources.cpu"),
    "memory_gb": ("Host memory per node (GB)", "resources.memory_gb"),
    "spot": ("Spot capacity", "Cloud spot instances are cheaper and can be taken back (placement.spot)."),
    "priority": ("Priority", "low, normal, high, critical or 0 to 1000 (priority)."),
    "preemptible": ("Preemptible", "The broker may stop it, and with a checkpoint move it (preemptible)."),
    "checkpoint_uri": ("Checkpoint URI", "s3://bucket/prefix or a path under a checkpoint root (checkpoint.uri)."),
    "checkpoint_interval": ("Checkpoint every (minutes)", "1 to 1440 (checkpoint.interval_minutes)."),
    "expected_duration_hours": ("Expected duration (hours)", "At A100 speed; prices the quote "
                                                             "(expected_duration_hours)."),
    "max_price": ("Max price (USD/hour)", "For the whole job (placement.max_price_per_hour)."),
}


def _choice(choices: list[tuple[str, str]], widget: type[forms.Widget] = forms.Select) -> forms.CharField:
    # A CharField under a select: a value outside the list reaches the API's ChoiceField, which says
    # '"x" is not a valid choice.' as the API does (Django's ChoiceField would say it otherwise).
    return forms.CharField(required=False, initial=choices[0][0], widget=widget(choices=choices))


class SubmitForm(forms.Form):
    """Concrete GPUs or compute units. Field names are the form's; SPEC_PATHS maps them to the spec."""

    name = _text(maxlength=200, autocomplete="off", spellcheck="false")
    command = _text(placeholder="python train.py --epochs 3", spellcheck="false")
    image = _text(placeholder="ghcr.io/acme/trainer:1.4", spellcheck="false")
    ask = _choice([("gpus", "Concrete GPUs"), ("cu", "Compute units")], widget=forms.RadioSelect)
    gpus = _num(min="1", max="64")
    compute_units = _num(step="any", min="0.01")
    # A plain Field under a multi-select: a name outside the list is the API's "Unknown GPU model(s)".
    gpu_models = forms.Field(required=False, widget=forms.SelectMultiple(attrs={"size": "6"}))
    min_gpu_memory_gb = _num(min="1")
    interconnect = _choice([
        ("any", "Any"), ("pcie", "PCIe: all GPUs on one node"), ("nvlink", "NVLink: one NVLink island")])
    nodes = _num(min="1", max="256")
    cpu = _num(step="any", min="0")
    memory_gb = _num(step="any", min="0")
    spot = _choice([
        ("never", "Never (on-demand only)"), ("allowed", "Allowed"), ("required", "Required (spot only)")])
    priority = _text(list="priority-names", placeholder="normal", autocomplete="off")
    preemptible = forms.BooleanField(required=False)
    checkpoint_uri = _text(placeholder="s3://bucket/prefix", spellcheck="false")
    checkpoint_interval = _num(min="1", max="1440")
    expected_duration_hours = _num(step="any", min="0")
    max_price = _num(step="any", min="0")

    def __init__(self, *args: Any, gpu_model_names: list[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["gpu_models"].widget.choices = [(n, n) for n in gpu_model_names]
        for name, field in self.fields.items():
            field.label, field.help_text = FIELD_TEXT[name]
            field.widget.attrs.setdefault("aria-describedby", f"{name}-hint {name}-error")

    def full_clean(self) -> None:
        super().full_clean()
        for name in self.errors:
            if name in self.fields:
                self.fields[name].widget.attrs["aria-invalid"] = "true"

    def add_error(self, field: str | None, error: Any) -> None:
        super().add_error(field, error)
        if field in self.fields:
            self.fields[field].widget.attrs["aria-invalid"] = "true"

    def spec(self) -> dict[str, Any]:
        """The spec in our format from what was typed; blank fields are left out (the API's defaults)."""
        d = self.cleaned_data
        spec: dict[str, Any] = {"name": d["name"]}
        if d["command"]:
            spec["command"] = shlex.split(d["command"])  # form_spec() turns a ValueError into the field's error
        if d["image"]:
            spec["image"] = d["image"]
        if d["priority"]:
            spec["priority"] = _number(d["priority"]) if _INT.match(d["priority"]) else d["priority"]
        if d["preemptible"]:
            spec["preemptible"] = True
        if d["expected_duration_hours"]:
            spec["expected_duration_hours"] = _number(d["expected_duration_hours"])
        resources: dict[str, Any] = {}
        if (d["ask"] or "gpus") == "cu":
            if d["compute_units"]:
                resources["compute_units"] = _number(d["compute_units"])
        elif d["gpus"]:
            resources["gpus"] = _number(d["gpus"])
        models = [m for m in (d["gpu_models"] or []) if isinstance(m, str)]
        if models:
            resources["gpu_models"] = models
        for key in ("min_gpu_memory_gb", "nodes", "cpu", "memory_gb"):
            if d[key]:
                resources[key] = _number(d[key])
        if d["interconnect"] and d["interconnect"] != "any":
            resources["interconnect"] = d["interconnect"]
        spec["resources"] = resources
        placement: dict[str, Any] = {}
        if d["spot"] and d["spot"] != "never":
            placement["spot"] = d["spot"]
        if d["max_price"]:
            placement["max_price_per_hour"] = _number(d["max_price"])
        if placement:
            spec["placement"] = placement
        checkpoint: dict[str, Any] = {}
        if d["checkpoint_uri"]:
            checkpoint["uri"] = d["checkpoint_uri"]
        if d["checkpoint_interval"]:
            checkpoint["interval_minutes"] = _number(d["checkpoint_interval"])
        if checkpoint:
            spec["checkpoint"] = checkpoint
        return spec


# Where each spec path's errors are shown on the form (longest prefix wins; the rest go on top).
SPEC_PATHS: dict[str, str] = {
    "name": "name", "command": "command", "image": "image", "priority": "priority",
    "preemptible": "preemptible", "expected_duration_hours": "expected_duration_hours",
    "resources.gpus": "gpus", "resources.compute_units": "compute_units", "resources.gpu_models": "gpu_models",
    "resources.min_gpu_memory_gb": "min_gpu_memory_gb", "resources.interconnect": "interconnect",
    "resources.nodes": "nodes", "resources.cpu": "cpu", "resources.memory_gb": "memory_gb",
    "placement.spot": "spot", "placement.max_price_per_hour": "max_price",
    "checkpoint.uri": "checkpoint_uri", "checkpoint.interval_minutes": "checkpoint_interval",
    "checkpoint": "checkpoint_uri",
}


def flat_errors(detail: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted path, message) for each error of a DRF error body, bounded like the API's answers
    (broker.api.errors.shorten: short excerpts, at most 20 entries per level)."""
    out: list[tuple[str, str]] = []
    detail = shorten(detail) if not prefix else detail
    if isinstance(detail, dict):
        for key, value in detail.items():
            key = str(key)
            path = prefix if key in ("non_field_errors", "code") else (f"{prefix}.{key}" if prefix else key)
            if key == "code":
                continue
            out += flat_errors(value, path)
    elif isinstance(detail, list):
        for index, value in enumerate(detail):
            if isinstance(value, (dict, list)):
                out += flat_errors(value, f"{prefix}.{index}" if prefix else str(index))
            else:
                out.append((prefix, str(value)))
    else:
        out.append((prefix, str(detail)))
    return out


def form_field_for(path: str) -> str | None:
    best = ""
    for spec_path in SPEC_PATHS:
        if (path == spec_path or path.startswith(spec_path + ".")) and len(spec_path) > len(best):
            best = spec_path
    return SPEC_PATHS.get(best)


def attach_errors(form: forms.Form, detail: Any) -> None:
    """Put each of the API's errors next to the form field it names; others become form-wide errors
    that say their path (e.g. "resources: The job asks for 32 GPUs; ...")."""
    for path, message in flat_errors(detail):
        field = form_field_for(path)
        if field is not None:
            form.add_error(field, message)
        else:
            form.add_error(None, f"{path}: {message}" if path else message)


def form_spec(form: SubmitForm) -> dict[str, Any] | None:
    """The spec of a bound form, or None with the errors on the form (a command that cannot be split, a
    value no field may hold)."""
    # The fields are lenient (the API's serializer judges the values); Django refuses only what no field
    # may hold, such as a NUL character, and such a field is missing from cleaned_data: say so, build nothing.
    if not form.is_valid():
        return None
    try:
        return form.spec()
    except ValueError as exc:  # shlex: "No closing quotation", "No escaped character"
        form.add_error("command", f"Cannot split the command into arguments: {exc}.")
        return None


class PasteForm(forms.Form):
    spec = forms.CharField(required=False, strip=False, widget=forms.Textarea(attrs={
        "rows": "18", "spellcheck": "false", "aria-describedby": "spec-hint spec-errors"}))


def parse_pasted(text: str) -> Any:
    """The pasted spec as JSON values, read as the API reads a body (broker.api.parsers: same byte,
    depth and value limits; YAML without anchors, aliases or tags). JSON when it starts with { or [."""
    raw = text.replace("\r\n", "\n").encode("utf-8", "surrogatepass")
    limit = settings.WHALEZEN_MAX_BODY_BYTES
    if len(raw) > limit:
        raise BodyError(f"Request body is larger than {limit} bytes.")
    if not raw.strip():
        raise BodyError("Paste a job spec (YAML or JSON).")
    return load_json(raw) if raw.lstrip()[:1] in (b"{", b"[") else load_yaml(raw)


def migrate_target(value: str) -> tuple[str, str] | None:
    """(node, pool) from the migrate select's value: "" (anywhere else), "node:NAME" or "pool:NAME"."""
    if not value:
        return "", ""
    kind, _, name = value.partition(":")
    if kind == "node" and name:
        return name, ""
    if kind == "pool" and name:
        return "", name
    return None


PRIORITY_CHOICES = [("", "Any")] + [(str(v), f"{k} ({v})") for k, v in PRIORITY_NAMES.items()]
STATE_CHOICES = JobState.choices
