"""Job submission: good specs in every accepted spelling, and bad ones answered with a 400 naming the field."""
from __future__ import annotations

import copy

import pytest

from broker.jobs.models import Job, JobEvent

from .conftest import MINIMAL_SPEC

URL = "/api/v1/jobs/"


def spec(**changes):
    out = copy.deepcopy(MINIMAL_SPEC)
    for dotted, value in changes.items():
        target = out
        *parents, leaf = dotted.split("__")
        for parent in parents:
            target = target.setdefault(parent, {})
        if value is DELETE:
            target.pop(leaf, None)
        else:
            target[leaf] = value
    return out


DELETE = object()


def test_submit_returns_pending_job_with_normalised_demand(acme):
    body = spec(resources={"gpus": 4, "gpu_models": ["a100-80gb"], "interconnect": "nvlink", "cpu": 8,
                           "memory_gb": 64},
                placement={"providers": ["aws", "onprem"], "spot": "allowed", "max_price_per_hour": 40},
                priority="high", preemptible=True, checkpoint={"uri": "s3://ckpt-bucket/run1", "interval_minutes": 15})
    resp = acme.client.post(URL, body, format="json")
    assert resp.status_code == 201, resp.content
    data = resp.json()
    assert data["state"] == "PENDING"
    assert data["priority"] == 100
    assert data["demand"]["gpus_per_node"] == 4
    assert data["demand"]["gpu_models"] == ["A100-80GB"]  # canonical spelling
    assert data["demand"]["cpu_milli"] == 8000 and data["demand"]["memory_mb"] == 65536
    assert data["pending_reason"]["code"] == "NOT_YET_SCHEDULED"
    job = Job.objects.get(pk=data["id"])
    assert job.tenant == acme.tenant and job.owner == acme.admin
    assert JobEvent.objects.filter(job=job, kind="submitted").count() == 1


def test_skypilot_accelerators_alias(acme):
    resp = acme.client.post(URL, spec(resources={"accelerators": "a100-80gb:8"}), format="json")
    assert resp.status_code == 201, resp.content
    demand = resp.json()["demand"]
    assert demand["gpus_per_node"] == 8 and demand["gpu_models"] == ["A100-80GB"]
    assert resp.json()["spec"]["resources"]["accelerators"] == "a100-80gb:8"


def test_kubernetes_limits_alias(acme):
    resp = acme.client.post(URL, spec(resources={"limits": {"nvidia.com/gpu": 2, "cpu": "500m", "memory": "16Gi"}}),
                            format="json")
    assert resp.status_code == 201, resp.content
    demand = resp.json()["demand"]
    assert (demand["gpus_per_node"], demand["cpu_milli"], demand["memory_mb"]) == (2, 500, 16384)
    assert resp.json()["spec"]["resources"]["limits"] == {"nvidia.com/gpu": 2, "cpu": "500m", "memory": "16Gi"}


def test_yaml_body(acme):
    yaml_body = (
        "name: yaml-job\ncommand: [python, -c, 'print(1)']\nresources:\n  gpu_fraction: 0.25\n"
        "placement:\n  spot: never\n"
    )
    resp = acme.client.post(URL, yaml_body, content_type="application/yaml")
    assert resp.status_code == 201, resp.content
    assert resp.json()["demand"]["gpu_milli"] == 250


def test_compute_units_request(acme):
    resp = acme.client.post(URL, spec(resources={"compute_units": 6.5}), format="json")
    assert resp.status_code == 201, resp.content
    assert resp.json()["demand"]["compute_units"] == 6.5


def test_image_only_job_is_accepted(acme):
    resp = acme.client.post(URL, spec(command=DELETE, image="ghcr.io/acme/train:1"), format="json")
    assert resp.status_code == 201, resp.content


# (description, body or raw text, the field path expected in the error body)
BAD_SPECS = [
    ("unknown top-level field", spec(bogus=1), ["bogus"]),
    ("unknown resources field", spec(resources__gpu_count=2), ["resources", "gpu_count"]),
    ("unknown placement field", spec(placement={"cloud": "aws"}), ["placement", "cloud"]),
    ("missing name", spec(name=DELETE), ["name"]),
    ("name with spaces", spec(name="my job"), ["name"]),
    ("name not a string", spec(name=12), ["name"]),
    ("no command and no image", spec(command=DELETE), ["command"]),
    ("command as a string", spec(command="python train.py"), ["command"]),
    ("empty command list", spec(command=[]), ["command"]),
    ("missing resources", spec(resources=DELETE), ["resources"]),
    ("no GPU request at all", spec(resources={"cpu": 4}), ["resources", "gpus"]),
    ("gpus as a string", spec(resources__gpus="four"), ["resources", "gpus"]),
    ("gpus as a boolean", spec(resources__gpus=True), ["resources", "gpus"]),
    ("negative gpus", spec(resources__gpus=-1), ["resources", "gpus"]),
    ("too many gpus per node", spec(resources__gpus=1000), ["resources", "gpus"]),
    ("fractional gpus", spec(resources__gpus=1.5), ["resources", "gpus"]),
    ("fraction with several GPUs", spec(resources={"gpus": 2, "gpu_fraction": 0.5}), ["resources", "gpu_fraction"]),
    ("fraction above one", spec(resources={"gpu_fraction": 1.5}), ["resources", "gpu_fraction"]),
    ("fraction of zero", spec(resources={"gpu_fraction": 0}), ["resources", "gpu_fraction"]),
    ("unknown GPU model", spec(resources={"gpus": 1, "gpu_models": ["Z9000"]}), ["resources", "gpu_models"]),
    ("unknown accelerator", spec(resources={"accelerators": "TPUv9:4"}), ["resources", "accelerators"]),
    ("malformed accelerator count", spec(resources={"accelerators": "A100-80GB:many"}), ["resources", "accelerators"]),
    ("accelerators and gpus together", spec(resources={"accelerators": "T4:1", "gpus": 2}), ["resources", "accelerators"]),
    ("nvlink across nodes", spec(resources={"gpus": 8, "nodes": 2, "interconnect": "nvlink"}), ["resources", "interconnect"]),
    ("unknown interconnect", spec(resources__interconnect="infiniband"), ["resources", "interconnect"]),
    ("zero nodes", spec(resources__nodes=0), ["resources", "nodes"]),
    ("negative cpu", spec(resources__cpu=-2), ["resources", "cpu"]),
    ("negative memory", spec(resources__memory_gb=-1), ["resources", "memory_gb"]),
    ("memory larger than any allowed model", spec(resources={"gpus": 1, "gpu_models": ["T4"], "min_gpu_memory_gb": 40}),
     ["resources", "min_gpu_memory_gb"]),
    ("compute units with concrete gpus", spec(resources={"compute_units": 4, "gpus": 2}), ["resources", "compute_units"]),
    ("negative compute units", spec(resources={"compute_units": -1}), ["resources", "compute_units"]),
    ("kubernetes limits with unknown resource", spec(resources={"limits": {"amd.com/gpu": 1}}), ["resources", "limits"]),
    ("kubernetes gpu limit not a number", spec(resources={"limits": {"nvidia.com/gpu": "two"}}), ["resources", "limits"]),
    ("unknown priority name", spec(priority="urgent"), ["priority"]),
    ("priority out of range", spec(priority=10**6), ["priority"]),
    ("preemptible as a string", spec(preemptible="yes"), ["preemptible"]),
    ("negative duration", spec(expected_duration_hours=-3), ["expected_duration_hours"]),
    ("deadline in the past", spec(deadline="2001-01-01T00:00:00Z"), ["deadline"]),
    ("deadline not a date", spec(deadline="next tuesday"), ["deadline"]),
    ("unknown provider", spec(placement={"providers": ["azure"]}), ["placement", "providers"]),
    ("unknown spot policy", spec(placement={"spot": "sometimes"}), ["placement", "spot"]),
    ("spot required on-prem only", spec(placement={"spot": "required", "providers": ["onprem"]}), ["placement", "spot"]),
    ("negative price ceiling", spec(placement={"max_price_per_hour": -5}), ["placement", "max_price_per_hour"]),
    ("relative checkpoint path", spec(checkpoint={"uri": "ckpt/run1"}), ["checkpoint", "uri"]),
    ("checkpoint path escaping", spec(checkpoint={"uri": "/data/../etc"}), ["checkpoint", "uri"]),
    ("checkpoint interval zero", spec(checkpoint={"uri": "/ckpt", "interval_minutes": 0}), ["checkpoint", "interval_minutes"]),
    ("env value not a string", spec(env={"A": 1}), ["env"]),
    ("env with reserved name", spec(env={"WHALEZEN_JOB_ID": "x"}), ["env"]),
    ("env with invalid name", spec(env={"1BAD": "x"}), ["env"]),
]


@pytest.mark.parametrize("description,body,field_path", BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_bad_spec_gets_400_naming_the_field(acme, description, body, field_path):
    before = Job.objects.count(), JobEvent.objects.count()
    resp = acme.client.post(URL, body, format="json")
    assert resp.status_code == 400, (description, resp.content)
    node = resp.json()
    for key in field_path:
        assert isinstance(node, dict) and key in node, (description, resp.json())
        node = node[key]
    assert node, "the error names a reason"
    assert (Job.objects.count(), JobEvent.objects.count()) == before, "nothing half-written"


@pytest.mark.parametrize("content_type,body", [
    ("application/json", "{not json"),
    ("application/json", "[1, 2, 3]"),
    ("application/yaml", "name: [unclosed"),
    ("application/json", "\"just a string\""),
])
def test_unparseable_or_non_object_body(acme, content_type, body):
    resp = acme.client.post(URL, body, content_type=content_type)
    assert resp.status_code == 400
    assert set(resp.json()) & {"body", "non_field_errors"}
    assert Job.objects.count() == 0


def test_ten_megabyte_body_is_refused_without_a_500(acme):
    huge = spec(env={"BLOB": "x" * (10 * 1024 * 1024)})
    resp = acme.client.post(URL, huge, format="json")
    assert resp.status_code == 400
    assert "body" in resp.json()
    assert Job.objects.count() == 0


def test_several_errors_are_reported_together(acme):
    resp = acme.client.post(URL, spec(bogus=1, name="bad name", resources__gpus="x"), format="json")
    assert resp.status_code == 400
    assert {"bogus", "name", "resources"} <= set(resp.json())


def test_job_larger_than_quota_is_refused(acme):
    acme.tenant.quota.max_gpus = 4
    acme.tenant.quota.save()
    resp = acme.client.post(URL, spec(resources={"gpus": 8}), format="json")
    assert resp.status_code == 400 and "resources" in resp.json()
    assert Job.objects.count() == 0


@pytest.mark.parametrize("path", sorted(__import__("pathlib").Path(__file__).resolve().parents[2].joinpath("examples").glob("job-*")))
def test_shipped_examples_are_accepted(acme, path):
    content_type = "application/yaml" if path.suffix in (".yaml", ".yml") else "application/json"
    resp = acme.client.post(URL, path.read_text(), content_type=content_type)
    assert resp.status_code == 201, resp.content


@pytest.mark.parametrize("resources,field", [
    ({"limits": {"nvidia.com/gpu": "\u0661"}}, "limits"),  # an Arabic-Indic digit one
    ({"accelerators": "T4:\u00b2"}, "accelerators"),  # a superscript two
    ({"limits": {"nvidia.com/gpu": 1, "cpu": "0.0000001"}}, "limits"),
])
def test_odd_numerals_and_vanishing_cpu_are_refused(acme, resources, field):
    resp = acme.client.post(URL, spec(resources=resources), format="json")
    assert resp.status_code == 400 and field in resp.json()["resources"], resp.content


# -- checkpoint URIs: local ones only under the operator's roots (WHALEZEN_CHECKPOINT_ROOTS) ------------
@pytest.fixture
def checkpoint_root(settings, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")  # a link inside the root that leads out of it
    (root / "team").mkdir()
    settings.WHALEZEN_CHECKPOINT_ROOTS = [str(tmp_path / "other-root"), str(root)]
    return root


@pytest.mark.parametrize("uri", ["file:///etc/passwd", "/etc", "/", "file:///", "{root}", "file://{root}",
                                 "{root}/../outside/run1", "{root}/escape/run1", "file://{root}/escape",
                                 "file://{root}/%2e%2e/outside", "{root}x/run1", "file://{root}/../etc",
                                 "//etc/run1", "{root}/team/./../../outside"])
def test_local_checkpoint_outside_the_roots_is_refused(acme, checkpoint_root, uri):
    uri = uri.format(root=checkpoint_root)
    resp = acme.client.post(URL, spec(checkpoint={"uri": uri}), format="json")
    assert resp.status_code == 400, (uri, resp.content)
    (reason,) = resp.json()["checkpoint"]["uri"]
    assert "checkpoint roots" in reason or "'..'" in reason, reason
    assert Job.objects.count() == 0


@pytest.mark.parametrize("uri", ["{root}/run1", "file://{root}/team/run1", "{root}/new/deeper/run1",
                                 "{root}/team/", "s3://ckpt-bucket/run1"])
def test_checkpoint_inside_a_root_or_on_s3_is_accepted(acme, checkpoint_root, uri):
    uri = uri.format(root=checkpoint_root)
    resp = acme.client.post(URL, spec(checkpoint={"uri": uri}), format="json")
    assert resp.status_code == 201, (uri, resp.content)
    assert resp.json()["spec"]["checkpoint"]["uri"] == uri  # stored as written


def test_default_checkpoint_root_is_under_the_var_dir(acme, settings):
    assert settings.WHALEZEN_CHECKPOINT_ROOTS == [str(settings.VAR_DIR / "checkpoints")]
    ok = acme.client.post(URL, spec(checkpoint={"uri": f"{settings.VAR_DIR}/checkpoints/run1"}), format="json")
    assert ok.status_code == 201, ok.content
    refused = acme.client.post(URL, spec(checkpoint={"uri": f"{settings.VAR_DIR}/whalezen.sqlite3"}), format="json")
    assert refused.status_code == 400 and "uri" in refused.json()["checkpoint"]


# -- error messages quote at most a short excerpt of a bad value -----------------------------------------
@pytest.mark.parametrize("body,field_path", [
    (spec(resources={"gpus": 1, "interconnect": "x" * 200_000}), ["resources", "interconnect"]),  # ChoiceField
    (spec(placement={"spot": "y" * 200_000}), ["placement", "spot"]),
    (spec(env={"B" * 100_000 + "-": "x"}), ["env"]),
    (spec(resources={"gpu_models": ["z" * 200]}), ["resources", "gpu_models"]),
    (spec(resources={"limits": {"k" * 100_000: 1}}), ["resources", "limits"]),
    (spec(**{"u" * 100_000: 1}), []),  # an unknown field: its key is cut too
])
def test_error_messages_quote_only_a_short_excerpt(acme, body, field_path):
    resp = acme.client.post(URL, body, format="json")
    assert resp.status_code == 400, resp.content[:300]
    assert len(resp.content) < 1200, resp.content[:300]
    node = resp.json()
    for key in field_path:
        node = node[key]
    assert node


def test_many_errors_are_counted_not_all_listed(acme):
    resp = acme.client.post(URL, spec(command=[1] * 1000), format="json")
    assert resp.status_code == 400
    errors = resp.json()["command"]
    assert len(errors) == 21 and errors["…"] == ["980 more fields with errors."]
    assert len(resp.content) < 3000


def test_yaml_spec_with_anchors_is_refused_before_expansion(acme):
    from bench.hostile_input import job_alias_bomb

    resp = acme.client.post(URL, job_alias_bomb(), content_type="application/yaml")
    assert resp.status_code == 400
    assert resp.json() == {"body": ["YAML anchors and aliases are not accepted (line 3, column 5)."]}
    harmless = "name: a\ncommand: &c [python]\nresources: {gpus: 1}\n"  # even one unused anchor
    assert acme.client.post(URL, harmless, content_type="application/yaml").status_code == 400
    assert Job.objects.count() == 0


def test_yaml_dates_and_tags_read_as_json_would(acme):
    dated = "name: a\ncommand: [python, '2026-01-01']\nresources: {gpus: 1}\nenv: {DAY: 2026-01-01}\n"
    resp = acme.client.post(URL, dated, content_type="application/yaml")
    assert resp.status_code == 201, resp.content
    assert resp.json()["spec"]["env"] == {"DAY": "2026-01-01"}  # a string, as in JSON
    tagged = "name: !!binary YWJj\ncommand: [python]\nresources: {gpus: 1}\n"
    resp = acme.client.post(URL, tagged, content_type="application/yaml")
    assert resp.status_code == 400 and "body" in resp.json()


def test_a_catalogue_read_by_a_function_reads_once_and_only_when_asked():
    from broker.jobs.spec import GpuCatalog

    reads = []

    def load():
        reads.append(1)
        return [("A100-80GB", 80, ["a100", "A100-SXM4-80GB"]), ("T4", 16, [])]

    catalog = GpuCatalog(load)
    assert reads == []
    assert catalog.resolve(" A100 ").name == "A100-80GB" and catalog.resolve("t4").memory_gb == 16
    assert catalog.resolve("H100") is None and catalog.names == ["A100-80GB", "T4"]
    assert reads == [1]
