"""Submitting from the console: the form and the pasted spec go through the API's serializer and
job_submit; errors sit next to the field in the API's words and nothing is created; the live quote."""
from __future__ import annotations

import html
import json
import re
from decimal import Decimal

import pytest

from broker.api.throttles import JobSubmitThrottle
from broker.jobs.models import Job

from .conftest import text_of

HX = {"HTTP_HX_REQUEST": "true"}
FORM = {"mode": "form", "name": "llama-ft", "command": "python train.py --lr '3e-4 warm'", "ask": "gpus",
        "gpus": "4", "nodes": "1", "interconnect": "nvlink", "spot": "never", "priority": "high"}


def error_of(resp, field: str) -> str:
    """The text of the error block that sits under one field."""
    match = re.search(rf'<div id="{field}-error">(.*?)</div>', resp.content.decode(), re.S)
    assert match, f"no error block for {field}"
    return html.unescape(re.sub(r"<[^>]+>", " ", match.group(1))).strip()


def test_submit_by_form_creates_the_job_as_typed(acme, as_member):
    resp = as_member.submit("/submit/", {
        **FORM, "gpu_models": ["A100-80GB", "h100-80gb"], "min_gpu_memory_gb": "40", "preemptible": "on",
        "checkpoint_uri": "s3://acme-ckpt/llama", "checkpoint_interval": "30", "expected_duration_hours": "6",
        "max_price": "30.5", "image": "ghcr.io/acme/trainer:1.4", "cpu": "16", "memory_gb": "128"})
    job = Job.objects.get()
    assert resp.status_code == 302 and resp.url == f"/jobs/{job.pk}/"
    assert (job.tenant, job.owner, job.name) == (acme.tenant, acme.member, "llama-ft")
    assert job.spec["command"] == ["python", "train.py", "--lr", "3e-4 warm"]
    assert job.spec["image"] == "ghcr.io/acme/trainer:1.4"
    assert (job.gpu_count, job.node_count, job.interconnect) == (4, 1, "nvlink")
    assert job.gpu_models == ["A100-80GB", "H100-80GB"] and job.min_gpu_memory_gb == 40
    assert (job.priority, job.preemptible, job.spot) == (100, True, "never")
    assert job.spec["checkpoint"] == {"uri": "s3://acme-ckpt/llama", "interval_minutes": 30}
    assert job.expected_duration_hours == 6 and job.max_price_per_hour == Decimal("30.5")
    assert (job.cpu_milli, job.memory_mb) == (16000, 128 * 1024)
    assert "submitted" in text_of(as_member.get(resp.url))


def test_submit_compute_units_on_spot(acme, as_admin):
    resp = as_admin.submit("/submit/", {**FORM, "ask": "cu", "compute_units": "2.5", "gpus": "4", "spot": "allowed",
                                        "interconnect": "any", "priority": "250"})
    assert resp.status_code == 302, text_of(resp)
    job = Job.objects.get()
    assert job.compute_units == Decimal("2.5") and job.gpu_count == 0 and "gpus" not in job.spec["resources"]
    assert (job.spot, job.priority) == ("allowed", 250)


@pytest.mark.parametrize("changes, field, words", [
    ({"gpus": "0"}, "gpus", "Ensure this value is greater than or equal to 1."),
    ({"gpus": "1.5"}, "gpus", "Must be a whole number."),
    ({"gpus": "four"}, "gpus", "Must be an integer."),
    ({"gpu_models": ["B300-999GB"]}, "gpu_models", "Unknown GPU model(s): 'B300-999GB'."),
    ({"priority": "urgent"}, "priority", "Must be one of low, normal, high, critical or an integer from 0 to 1000."),
    ({"priority": "1001"}, "priority", "Must be one of low, normal"),
    ({"name": "no spaces please"}, "name", "Use 1-200 letters, digits"),
    ({"name": ""}, "name", "This field may not be blank."),
    ({"spot": "sometimes"}, "spot", '"sometimes" is not a valid choice.'),
    ({"nodes": "2"}, "interconnect", "NVLink does not span nodes"),
    ({"command": "python 'unclosed"}, "command", "Cannot split the command into arguments: No closing quotation."),
    ({"command": ""}, "command", "Give a command, an image, or both."),
    ({"checkpoint_uri": "file:///etc/passwd"}, "checkpoint_uri", "Local checkpoints must be inside one of the checkpoint roots"),
    ({"checkpoint_interval": "30"}, "checkpoint_uri", "This field is required."),
    ({"min_gpu_memory_gb": "100", "gpu_models": ["A100-80GB"]}, "min_gpu_memory_gb", "the largest has 80 GB"),
])
def test_a_bad_field_rerenders_with_the_apis_error_next_to_it_and_creates_nothing(acme, as_member, changes, field, words):
    resp = as_member.submit("/submit/", {**FORM, **changes})
    assert resp.status_code == 400
    assert words in error_of(resp, field)
    assert 'aria-invalid="true"' in resp.content.decode()
    assert not Job.objects.exists()
    # What was typed is kept.
    if "name" not in changes:
        assert 'value="llama-ft"' in resp.content.decode()


def test_the_quota_refusal_is_shown_on_the_form(acme, as_member):
    acme.tenant.quota.max_gpus = 2
    acme.tenant.quota.save()
    resp = as_member.submit("/submit/", FORM)
    assert resp.status_code == 400
    assert "resources: The job asks for 4 GPUs; your tenant's quota allows 2 at once." in text_of(resp).replace("&#x27;", "'")
    assert not Job.objects.exists()


def test_the_submit_throttle_is_the_apis(acme, as_member, monkeypatch):
    monkeypatch.setitem(JobSubmitThrottle.THROTTLE_RATES, "job_submit", "1/min")
    assert as_member.submit("/submit/", FORM).status_code == 302
    resp = as_member.submit("/submit/", FORM)
    assert resp.status_code == 429 and "Request was throttled." in text_of(resp)
    assert Job.objects.count() == 1


PASTED_YAML = """\
name: pasted-run
command: [python, train.py]
priority: low
resources:
  accelerators: "A100-80GB:2"
placement:
  spot: never
"""


def test_a_pasted_yaml_spec_is_submitted(acme, as_member):
    resp = as_member.submit("/submit/", {"mode": "paste", "spec": PASTED_YAML.replace("\n", "\r\n")})
    job = Job.objects.get()
    assert resp.status_code == 302 and resp.url == f"/jobs/{job.pk}/"
    assert (job.name, job.gpu_count, job.gpu_models, job.priority) == ("pasted-run", 2, ["A100-80GB"], 10)
    assert job.spec["resources"] == {"accelerators": "A100-80GB:2"}


def test_a_pasted_json_spec_is_submitted(acme, as_member):
    spec = {"name": "json-run", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}}}
    resp = as_member.submit("/submit/", {"mode": "paste", "spec": json.dumps(spec)})
    assert resp.status_code == 302
    assert Job.objects.get().memory_mb == 8192


@pytest.mark.parametrize("text, words", [
    ("a: &x [1, 2]\nb: *x\n", "YAML anchors and aliases are not accepted (line 1, column 4)."),
    ("lol: &a [x, x, x]\nlol2: &b [*a, *a, *a]\nlol3: [*b, *b, *b]\n", "YAML anchors and aliases are not accepted"),
    ("name: !!python/object:os.system x\n", "Body is not valid YAML"),
    ("{" * 40 + "}" * 40, "nested deeper than 32 levels"),
    ("", "Paste a job spec"),
])
def test_a_hostile_pasted_spec_is_refused_with_a_message(acme, as_member, text, words):
    resp = as_member.submit("/submit/", {"mode": "paste", "spec": text})
    assert resp.status_code == 400
    assert words in text_of(resp).replace("&#x27;", "'")
    assert not Job.objects.exists()


def test_a_paste_larger_than_the_apis_body_limit_is_a_400_not_a_500(acme, as_member, settings):
    # Django refuses the request body itself (DATA_UPLOAD_MAX_MEMORY_SIZE is the API's body limit)
    # before the page reads it: its plain 400 page, and nothing created.
    resp = as_member.submit("/submit/", {"mode": "paste", "spec": "x" * (settings.WHALEZEN_MAX_BODY_BYTES + 10)})
    assert resp.status_code == 400 and not Job.objects.exists()


def test_pasted_spec_errors_are_listed_by_field_path(acme, as_member):
    resp = as_member.submit("/submit/", {"mode": "paste", "spec": "name: x\ncommand: [a]\nresources:\n  gpus: 0\n  bogus: 1\n"})
    assert resp.status_code == 400
    text = text_of(resp)
    assert "resources.gpus : Ensure this value is greater than or equal to 1." in text
    assert "resources.bogus : Unknown field." in text
    assert not Job.objects.exists()


def test_the_quote_fragment_prices_a_placeable_spec(acme, as_member):
    acme.pool.gpu_hour_rate_usd = Decimal("2.50")
    acme.pool.save()
    resp = as_member.submit("/submit/quote/", {"mode": "form", "name": "", "command": "python x.py", "gpus": "2",
                                               "expected_duration_hours": "3"}, **HX)
    assert resp.status_code == 200
    text = text_of(resp)
    assert "<html" not in resp.content.decode()
    assert "2 × A100-80GB" in text and "$5.0000" in text and "$15.00" in text  # 2 GPUs x $2.50, for 3 h
    assert "pool onprem" in text and "node acme-a100-" in text
    assert not Job.objects.exists()


def test_the_quote_says_why_a_spec_cannot_be_placed_or_is_wrong(acme, as_member):
    big = as_member.submit("/submit/quote/", {"mode": "form", "command": "x", "gpus": "16"}, **HX)
    assert big.status_code == 200 and "cannot be placed now" in text_of(big) and "INSUFFICIENT_GPUS" in text_of(big)
    bad = as_member.submit("/submit/quote/", {"mode": "form", "command": "x", "gpus": "0"}, **HX)
    # A 400, which the page swaps in (base.html's htmx responseHandling): no stale price stays on screen.
    assert bad.status_code == 400 and "Not quotable yet" in text_of(bad)
    assert "GPUs per node : Ensure this value is greater than or equal to 1." in text_of(bad)
    assert as_member.submit("/submit/quote/", {"mode": "form", "command": "x", "gpus": "0"}).status_code == 400
    pasted = as_member.submit("/submit/quote/", {"mode": "paste", "spec": "a: &x 1\nb: *x"}, **HX)
    assert "anchors and aliases" in text_of(pasted) and "$" not in text_of(pasted)


def test_a_viewer_sees_the_form_read_only_and_cannot_post(acme, as_viewer):
    page = as_viewer.get("/submit/")
    html = page.content.decode()
    assert page.status_code == 200 and "only members and admins submit jobs" in text_of(page)
    assert "<fieldset disabled>" in html and "Submit job</button>" not in html and "hx-post" not in html
    assert as_viewer.submit("/submit/", FORM).status_code == 403
    assert as_viewer.submit("/submit/", {"mode": "paste", "spec": PASTED_YAML}).status_code == 403
    assert as_viewer.submit("/submit/quote/", FORM, **HX).status_code == 403
    assert not Job.objects.exists()


def test_the_submit_page_offers_the_catalogue_and_the_paste_tab(acme, as_member):
    form = as_member.get("/submit/").content.decode()
    assert '<option value="H100-80GB">H100-80GB</option>' in form and 'name="gpus"' in form
    assert re.search(r'<label for="id_gpus">GPUs per node</label>', form)
    paste = as_member.get("/submit/?mode=paste")
    assert '<textarea name="spec"' in paste.content.decode() and "llama-finetune" in text_of(paste)


SKYPILOT_TASK = """\
resources:
  accelerators: {A100-80GB:2, T4:4}
  disk_size: 256
envs:
  HF_TOKEN: null
run: python train.py
"""
POD = """\
apiVersion: v1
kind: Pod
metadata: {name: pod-run}
spec:
  containers:
    - name: main
      image: nvcr.io/nvidia/pytorch:24.05-py3
      command: [python, train.py]
      resources: {limits: {nvidia.com/gpu: 2}}
"""


def test_a_pasted_skypilot_task_is_previewed_with_what_would_block_it(acme, as_member):
    resp = as_member.submit("/submit/quote/", {"mode": "paste", "spec": SKYPILOT_TASK}, **HX)
    assert resp.status_code == 200
    text = text_of(resp)
    assert "Read as a SkyPilot task file" in text
    assert "A submission would be refused" in text and "envs.HF_TOKEN" in text
    assert "resources.disk_size" in text  # the warning
    submitted = as_member.submit("/submit/", {"mode": "paste", "spec": SKYPILOT_TASK})
    assert submitted.status_code == 400 and "HF_TOKEN" in text_of(submitted) and not Job.objects.exists()
    filled = as_member.submit("/submit/", {"mode": "paste", "spec": SKYPILOT_TASK.replace("null", "hf_x")})
    assert filled.status_code == 302
    assert Job.objects.get().gpu_alternatives == {"A100-80GB": 2, "T4": 4}


def test_a_pasted_kubernetes_pod_is_submitted(acme, as_member):
    resp = as_member.submit("/submit/", {"mode": "paste", "spec": POD})
    assert resp.status_code == 302, text_of(resp)
    job = Job.objects.get()
    assert (job.name, job.gpu_count, job.spec["format"], job.spec["image"]) == (
        "pod-run", 2, "kubernetes", "nvcr.io/nvidia/pytorch:24.05-py3")
