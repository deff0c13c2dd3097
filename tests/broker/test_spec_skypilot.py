"""SkyPilot task files through POST /api/v1/jobs/: real task files in the shapes SkyPilot's documentation
shows, each with the demand it must produce; refused fields by name; the dry run; model spellings the
team cannot reach; and a job with accelerator alternatives placed on the one that fits."""
from __future__ import annotations

import pytest
import yaml

from broker.inventory.services import node_create_simulated
from broker.jobs.formats.skypilot import SETUP_THEN_RUN
from broker.jobs.models import Job
from tests.tarballs import archive

URL = "/api/v1/jobs/"

# SkyPilot's quickstart shape: workdir-less, setup + run, a GPU per node.
HELLO = """
name: hello-sky
resources:
  accelerators: A100-80GB:1
setup: |
  echo "Running setup."
run: |
  echo "Hello, SkyPilot!"
"""

# A distributed training task: several nodes, an accelerator set in flow style, min CPUs and memory,
# spot, a location, env and a secret.
DISTRIBUTED = """
resources:
  accelerators: {A100-80GB:8, H100:8}
  cpus: 32+
  memory: 256+
  use_spot: true
  infra: aws/us-east-1
  disk_size: 512
num_nodes: 2
envs:
  MODEL: llama-3-8b
  EPOCHS: 3
  WANDB_API_KEY: null
secrets:
  HF_TOKEN: hf_abc
run: |
  torchrun --nnodes=$SKYPILOT_NUM_NODES --node_rank=$SKYPILOT_NODE_RANK train.py --model $MODEL
"""

# An inference task in a container, alternatives through any_of.
SERVE = """
name: vllm-bench
resources:
  image_id: docker:vllm/vllm-openai:latest
  ports: 8000
  any_of:
    - accelerators: L4:1
    - accelerators: A100-80GB:1
run: python -m vllm.entrypoints.openai.api_server --model $MODEL
envs:
  MODEL: mistralai/Mistral-7B-Instruct-v0.2
service:
  replicas: 2
"""


def post(world, text: str, **query):
    params = "&".join(f"{k}={v}" for k, v in query.items())
    return world.client.post(URL + (f"?{params}" if params else ""), data=text, content_type="application/yaml")


@pytest.fixture
def mixed(acme, gpu_models):
    """acme with an L4 and an H100 node besides its two A100-80GB nodes."""
    node_create_simulated(pool=acme.pool, name="acme-l4", gpu_model=gpu_models["L4"], gpu_count=4, nvlink_island_size=0,
                          cpu_milli=64000, memory_mb=256 * 1024)
    node_create_simulated(pool=acme.pool, name="acme-h100", gpu_model=gpu_models["H100-80GB"], gpu_count=8,
                          nvlink_island_size=8, cpu_milli=192000, memory_mb=2048 * 1024)
    return acme


def test_the_quickstart_task_runs_setup_then_run_in_bash(acme):
    resp = post(acme, HELLO)
    assert resp.status_code == 201, resp.content
    body = resp.json()
    assert body["format"] == "skypilot" and body["name"] == "hello-sky"
    assert body["demand"]["gpus_per_node"] == 1 and body["demand"]["gpu_models"] == ["A100-80GB"]
    command = body["spec"]["command"]
    assert command[:4] == ["/bin/bash", "-c", SETUP_THEN_RUN, "whalezen-task"]
    assert command[4:] == ['echo "Running setup."', 'echo "Hello, SkyPilot!"']
    assert body["warnings"] == []


def test_setup_first_and_its_failure_ends_the_job_with_its_code(tmp_path):
    import subprocess

    ok = subprocess.run(["/bin/bash", "-c", SETUP_THEN_RUN, "whalezen-task", "echo one > f", "cat f; echo two"],
                        cwd=tmp_path, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout == "one\ntwo\n"
    failed = subprocess.run(["/bin/bash", "-c", SETUP_THEN_RUN, "whalezen-task", "exit 7", "echo never"],
                            cwd=tmp_path, capture_output=True, text=True)
    assert failed.returncode == 7 and "never" not in failed.stdout
    assert "setup failed with exit code 7" in failed.stderr


def test_a_distributed_task_with_alternatives_spot_location_env_and_secrets(mixed):
    resp = post(mixed, DISTRIBUTED.replace("WANDB_API_KEY: null", "WANDB_API_KEY: abc"))
    assert resp.status_code == 201, resp.content
    body = resp.json()
    demand, spec = body["demand"], body["spec"]
    assert demand["nodes"] == 2 and demand["gpus_per_node"] == 8 and demand["total_gpus"] == 16
    assert demand["gpu_models"] == ["A100-80GB", "H100-80GB"]
    assert demand["cpu_milli"] == 32000 and demand["memory_mb"] == 256 * 1024 and demand["spot"] == "required"
    assert spec["placement"] == {"spot": "required", "providers": ["aws"], "regions": ["us-east-1"]}
    assert spec["env"] == {"MODEL": "llama-3-8b", "EPOCHS": "3", "WANDB_API_KEY": "abc"}
    # The secret's value is kept for the job's processes, never in the spec anyone reads back.
    assert spec["secrets"] == ["HF_TOKEN"] and "hf_abc" not in resp.content.decode()
    assert Job.objects.get(pk=body["id"]).secret_env == {"HF_TOKEN": "hf_abc"}
    assert [w["field"] for w in body["warnings"]] == ["resources.disk_size"]


def test_secrets_reach_the_job_through_its_assignment_only(acme):
    from broker.agents.selectors import node_assignments
    from broker.jobs.models import JobEvent
    from broker.scheduler.services import scheduling_cycle_run

    resp = post(acme, "resources: {accelerators: A100-80GB:1}\nrun: echo $HF_TOKEN | wc -c\n"
                      "secrets: {HF_TOKEN: hf_secret_value}\nenvs: {A: b}\n")
    assert resp.status_code == 201, resp.content
    scheduling_cycle_run(tenant=acme.tenant)
    job = Job.objects.get(pk=resp.json()["id"])
    node = job.allocations.get(active=True).node
    (assignment,) = node_assignments(node=node)["assignments"]
    assert assignment["env"] == {"A": "b", "HF_TOKEN": "hf_secret_value"}
    assert "hf_secret_value" not in str(job.spec) + str(list(JobEvent.objects.filter(job=job).values()))
    assert "hf_secret_value" not in acme.client.get(f"{URL}{job.pk}/events/").content.decode()


def test_alternatives_keep_their_own_counts_and_the_engine_places_the_one_that_fits(mixed):
    from broker.scheduler.services import scheduling_cycle_run

    # The H100 node is full first: 8 H100s are busy.
    blocker = post(mixed, "resources: {accelerators: H100:8}\nrun: sleep 1\n")
    assert blocker.status_code == 201
    scheduling_cycle_run(tenant=mixed.tenant)
    assert [a["node"] for a in mixed.client.get(f"{URL}{blocker.json()['id']}/").json()["allocations"]] == ["acme-h100"]

    resp = post(mixed, "resources:\n  accelerators: {H100:8, L4:2}\nrun: python infer.py\n")
    assert resp.status_code == 201, resp.content
    demand = resp.json()["demand"]
    assert demand["gpu_alternatives"] == {"H100-80GB": 8, "L4": 2} and demand["gpus_per_node"] == 2
    scheduling_cycle_run(tenant=mixed.tenant)
    placed = mixed.client.get(f"{URL}{resp.json()['id']}/").json()
    # Not waiting for 8 H100s: on the L4 node, with the L4 alternative's own count.
    assert placed["state"] != "PENDING", placed["pending_reason"]
    assert [(a["node"], len(a["gpus"])) for a in placed["allocations"]] == [("acme-l4", 2)]


def test_an_alternative_placed_takes_its_own_count_not_the_smallest(mixed):
    from broker.scheduler.services import scheduling_cycle_run

    # The L4 node is full: the job goes to the H100 node, and there it needs 8 GPUs, not 2.
    assert post(mixed, "resources: {accelerators: L4:4}\nrun: sleep 1\n").status_code == 201
    scheduling_cycle_run(tenant=mixed.tenant)
    resp = post(mixed, "resources:\n  accelerators: {H100:8, L4:2}\nrun: python infer.py\n")
    scheduling_cycle_run(tenant=mixed.tenant)
    placed = mixed.client.get(f"{URL}{resp.json()['id']}/").json()
    assert [(a["node"], len(a["gpus"])) for a in placed["allocations"]] == [("acme-h100", 8)]


def test_any_of_in_a_container_with_fields_that_do_not_change_a_batch_run(mixed):
    resp = post(mixed, SERVE)
    assert resp.status_code == 201, resp.content
    body = resp.json()
    assert body["spec"]["image"] == "vllm/vllm-openai:latest"
    assert body["demand"]["gpu_models"] == ["A100-80GB", "L4"] and body["demand"]["gpus_per_node"] == 1
    assert {w["field"] for w in body["warnings"]} == {"service", "resources.ports"}


@pytest.mark.parametrize("accelerators, models, per_node, alternatives", [
    ('"A100-80GB:4"', ["A100-80GB"], 4, {}),
    ("A100-80GB", ["A100-80GB"], 1, {}),
    ("{A100-80GB: 2}", ["A100-80GB"], 2, {}),
    ('["L4:4", "A100-80GB:2"]', ["A100-80GB", "L4"], 2, {"A100-80GB": 2, "L4": 4}),
    ("{L4:4, A100-80GB:4}", ["A100-80GB", "L4"], 4, {}),
    ("{L4: 8, A100-80GB: 2}", ["A100-80GB", "L4"], 2, {"A100-80GB": 2, "L4": 8}),
])
def test_every_yaml_spelling_of_accelerators(mixed, accelerators, models, per_node, alternatives):
    resp = post(mixed, f"resources:\n  accelerators: {accelerators}\nrun: nvidia-smi\n", dry_run=1)
    assert resp.status_code == 200, resp.content
    demand = resp.json()["demand"]
    assert (demand["gpu_models"], demand["gpus_per_node"], demand["gpu_alternatives"]) == (models, per_node,
                                                                                            alternatives)


def test_a_share_of_a_gpu(acme):
    resp = post(acme, "resources: {accelerators: 'A100-80GB:0.5'}\nrun: python small.py\n", dry_run=1)
    assert resp.status_code == 200, resp.content
    assert resp.json()["demand"]["gpu_milli"] == 500


@pytest.mark.parametrize("value, cpu_milli", [(4, 4000), ("4", 4000), ("4+", 4000), ("0.5+", 500)])
def test_cpus(acme, value, cpu_milli):
    resp = post(acme, f"resources: {{accelerators: A100-80GB, cpus: {value!r}}}\nrun: x\n", dry_run=1)
    assert resp.status_code == 200, resp.content
    assert resp.json()["demand"]["cpu_milli"] == cpu_milli


@pytest.mark.parametrize("value, memory_mb", [(32, 32768), ("32+", 32768), ("64GB", 65536), ("1TB+", 1024 * 1024),
                                              ("512MB", 512)])
def test_memory(acme, value, memory_mb):
    resp = post(acme, f"resources: {{accelerators: A100-80GB, memory: {value!r}}}\nrun: x\n", dry_run=1)
    assert resp.status_code == 200, resp.content
    assert resp.json()["demand"]["memory_mb"] == memory_mb


def test_memory_per_cpu(acme):
    resp = post(acme, "resources: {accelerators: A100-80GB, cpus: 8, memory: 4x}\nrun: x\n", dry_run=1)
    assert resp.json()["demand"]["memory_mb"] == 32 * 1024


@pytest.mark.parametrize("location, placement, warned", [
    ("infra: gcp", {"providers": ["gcp"]}, False),
    ("infra: aws/us-west-2", {"providers": ["aws"], "regions": ["us-west-2"]}, False),
    ("infra: aws/us-east-1/us-east-1a", {"providers": ["aws"], "regions": ["us-east-1"]}, True),
    ("infra: '*/us-central1'", {"regions": ["us-central1"]}, False),
    ("cloud: aws\n  region: eu-west-1", {"providers": ["aws"], "regions": ["eu-west-1"]}, False),
    ("zone: us-central1-a", {"regions": ["us-central1"]}, True),
])
def test_locations(acme, location, placement, warned):
    resp = post(acme, f"resources:\n  accelerators: A100-80GB\n  {location}\nrun: x\n", dry_run=1)
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert body["spec"].get("placement", {}) == placement
    assert any("Zones are not pinned" in w["message"] for w in body["warnings"]) == warned


def test_any_of_over_places_with_one_model(acme):
    task = ("resources:\n  accelerators: A100-80GB:2\n  any_of:\n    - infra: aws/us-east-1\n"
            "    - infra: aws/us-west-2\nrun: x\n")
    body = post(acme, task, dry_run=1).json()
    assert body["spec"]["placement"] == {"providers": ["aws"], "regions": ["us-east-1", "us-west-2"]}


def test_ordered_is_taken_as_any_of_and_says_so(mixed):
    task = "resources:\n  ordered:\n    - accelerators: H100:1\n    - accelerators: L4:1\nrun: x\n"
    body = post(mixed, task, dry_run=1).json()
    assert body["demand"]["gpu_models"] == ["H100-80GB", "L4"]
    assert any(w["field"] == "resources.ordered" and "cheapest" in w["message"] for w in body["warnings"])


def test_a_task_without_a_name_gets_one(acme):
    resp = post(acme, "resources: {accelerators: A100-80GB}\nrun: echo hi\n")
    assert resp.status_code == 201, resp.content
    assert resp.json()["name"].startswith("task-")


def test_whalezen_options_ride_along(acme):
    task = ("resources: {accelerators: A100-80GB:4}\nrun: python train.py\n"
            "whalezen: {priority: high, preemptible: true, interconnect: nvlink}\n")
    body = post(acme, task).json()
    assert body["priority"] == 100 and body["preemptible"] is True
    assert body["demand"]["interconnect"] == "nvlink"


def test_declaring_the_format(acme):
    # Only `resources` and `name`: it would read as a native spec; ?spec_format= says what it is.
    native_looking = {"name": "x", "resources": {"accelerators": "A100-80GB:1"}}
    refused = acme.client.post(URL, native_looking, format="json")
    assert refused.status_code == 400 and "command" in refused.json()
    declared = acme.client.post(URL + "?spec_format=skypilot&dry_run=1", native_looking, format="json")
    assert declared.status_code == 400 and "run" in declared.json()  # a SkyPilot task with nothing to run
    bad = acme.client.post(URL + "?spec_format=slurm", native_looking, format="json")
    assert bad.status_code == 400 and "spec_format" in bad.json()


# -- refused fields, each with its message ---------------------------------------------------------------
@pytest.mark.parametrize("task, path, words", [
    ("resources: {accelerators: A100-80GB, instance_type: p4d.24xlarge}\nrun: x", ("resources", "instance_type"),
     "WhaleZen picks the instance type"),
    ("resources: {accelerators: A100-80GB, infra: azure}\nrun: x", ("resources", "infra"), "not on 'azure'"),
    ("resources: {accelerators: A100-80GB, infra: k8s}\nrun: x", ("resources", "infra"), "Kubernetes clusters"),
    ("resources: {accelerators: A100-80GB, image_id: ami-0868a20f5a3bf9702}\nrun: x", ("resources", "image_id"),
     "docker:<image>"),
    ("resources: {accelerators: A100-80GB, cpus: lots}\nrun: x", ("resources", "cpus"), "8+"),
    ("resources: {accelerators: A100-80GB, memory: 32PB}\nrun: x", ("resources", "memory"), "Units KB, MB, GB or TB"),
    ("resources: {accelerators: A100-80GB, use_spot: maybe}\nrun: x", ("resources", "use_spot"), "true or false"),
    ("resources: {accelerators: A100-80GB}\nnum_nodes: 0\nrun: x", ("num_nodes",), "at least 1"),
    ("resources: {accelerators: A100-80GB}\nrun: [a, b]", ("run",), "shell script"),
    ("resources: {accelerators: A100-80GB}\nsetup: pip install x", ("run",), "needs a run script"),
    ("resources: {cpus: 4}\nrun: x", ("resources", "accelerators"), "GPU jobs"),
    ("resources: {accelerators: A100-80GB}\nrun: x\nenvs: [A, B]", ("envs",), "NAME: value"),
    ("resources: {accelerators: A100-80GB}\nrun: x\ntypo_field: 1", ("typo_field",), "Not a SkyPilot task field"),
    # An unknown key is named as written, dots and brackets included, not read as a path.
    ("resources: {accelerators: A100-80GB}\nrun: x\nresources.cpus: 4", ("resources.cpus",), "Not a SkyPilot task"),
    ("resources: {accelerators: A100-80GB}\nrun: x\n'0.': 1", ("0.",), "Not a SkyPilot task field"),
    ("resources: {accelerators: A100-80GB}\nrun: x\n'files[0]': 1", ("files[0]",), "Not a SkyPilot task field"),
    ("resources: {accelerators: A100-80GB, gpus_please: 1}\nrun: x", ("resources", "gpus_please"),
     "Not a SkyPilot resources field"),
    ("resources:\n  any_of:\n    - {accelerators: L4, infra: gcp}\n    - {accelerators: A100-80GB, infra: aws}\n"
     "run: x", ("resources", "any_of"), "every combination"),
    ("resources:\n  any_of:\n    - {accelerators: L4, cpus: 4}\n    - {accelerators: A100-80GB, cpus: 8}\n"
     "run: x", ("resources", "any_of[1]"), "not in cpus"),
    ("resources: {accelerators: A100-80GB}\nrun: x\nwhalezen: {queue: fast}", ("whalezen", "queue"), "Options here"),
])
def test_refused_fields_name_themselves(acme, task, path, words):
    resp = post(acme, task)
    assert resp.status_code == 400, resp.content
    detail = resp.json()
    for part in path:
        detail = detail[part]
    assert words in " ".join(detail if isinstance(detail, list) else sum(detail.values(), []))
    assert Job.objects.count() == 0


def test_hostile_values_in_any_field_are_a_400_never_a_500(acme):
    hostile = [None, True, 7, -1, 1e308, "", "x" * 10000, [], [1, [2]], {}, {"a": {"b": None}}]
    fields = ["name", "resources", "resources.accelerators", "resources.cpus", "resources.memory",
              "resources.infra", "resources.any_of", "resources.image_id", "num_nodes", "envs", "secrets",
              "run", "setup", "whalezen", "file_mounts"]
    for field in fields:
        for value in hostile:
            task = {"resources": {"accelerators": "A100-80GB:1"}, "run": "x"}
            head, _, leaf = field.partition(".")
            if leaf:
                task[head] = {**task[head], leaf: value}
            else:
                task[head] = value
            resp = acme.client.post(URL + "?spec_format=skypilot&dry_run=1", task, format="json")
            assert resp.status_code in (200, 400), (field, value, resp.content[:300])


# -- the dry run --------------------------------------------------------------------------------------
def test_dry_run_lists_what_would_block_a_real_submission_and_creates_nothing(acme):
    task = DISTRIBUTED.replace("H100:8", "A100-80GB:8").replace("{A100-80GB:8, A100-80GB:8}", "A100-80GB:8")
    task += "workdir: .\n"
    dry = post(acme, task, dry_run=1)
    assert dry.status_code == 200, dry.content
    body = dry.json()
    assert body["dry_run"] is True and body["format"] == "skypilot"
    assert {p["field"] for p in body["problems"]} == {"envs.WANDB_API_KEY", "workdir"}
    assert body["demand"]["total_gpus"] == 16
    assert Job.objects.count() == 0
    real = post(acme, task)
    assert real.status_code == 400
    assert "WANDB_API_KEY" in real.json()["envs"] and "workdir" in real.json()
    assert Job.objects.count() == 0


def test_dry_run_of_a_malformed_file_is_still_a_400(acme):
    resp = post(acme, "resources: {accelerators: A100-80GB, cpus: many}\nrun: x\n", dry_run=1)
    assert resp.status_code == 400 and "cpus" in resp.json()["resources"]


def test_dry_run_of_a_native_spec(acme):
    resp = acme.client.post(URL + "?dry_run=1", {"name": "n", "command": ["true"], "resources": {"gpus": 2}},
                            format="json")
    assert resp.status_code == 200 and resp.json()["format"] == "whalezen"
    assert resp.json()["demand"]["total_gpus"] == 2 and Job.objects.count() == 0


def test_dry_run_is_for_members_only_like_a_submission(acme):
    resp = acme.viewer_client.post(URL + "?dry_run=1", {"name": "n", "command": ["true"], "resources": {"gpus": 1}},
                                   format="json")
    assert resp.status_code == 403


# -- model spellings the team cannot reach ----------------------------------------------------------------
def test_a100_means_the_40gb_model_and_this_team_has_only_80gb(acme):
    resp = post(acme, "resources: {accelerators: A100:8}\nrun: python train.py\n")
    assert resp.status_code == 400
    message = " ".join(resp.json()["resources"]["accelerators"])
    assert "'A100' (that is A100-40GB, 40 GB)" in message and "This team can reach A100-80GB" in message
    dry = post(acme, "resources: {accelerators: A100:8}\nrun: python train.py\n", dry_run=1)
    assert dry.status_code == 200
    assert [p["field"] for p in dry.json()["problems"]] == ["resources.accelerators"]


def test_an_unreachable_alternative_is_a_warning_when_another_is_reachable(acme):
    resp = post(acme, "resources: {accelerators: [A100:8, A100-80GB:8]}\nrun: x\n")
    assert resp.status_code == 201, resp.content
    assert any("A100-40GB" in w["message"] for w in resp.json()["warnings"])


def test_another_teams_gpus_are_not_reachable(acme, globex, gpu_models):
    node_create_simulated(pool=globex.pool, name="globex-h100", gpu_model=gpu_models["H100-80GB"], gpu_count=8,
                          nvlink_island_size=8, cpu_milli=96000, memory_mb=1024 * 1024)
    resp = post(acme, "resources: {accelerators: H100:8}\nrun: x\n")
    assert resp.status_code == 400 and "H100" in str(resp.json())
    assert post(globex, "resources: {accelerators: H100:8}\nrun: x\n").status_code == 201


def test_the_yaml_flow_set_parses_as_keys_without_values():
    # What the API's YAML parser gives for SkyPilot's `{L4:8, A100:4}` (the reason for the dict-of-None form).
    assert yaml.safe_load("{L4:8, A100:4}") == {"L4:8": None, "A100:4": None}


# -- workdir and file_mounts -----------------------------------------------------------------------------
def test_file_mounts_from_buckets_are_copied_before_setup(acme):
    task = ("resources: {accelerators: A100-80GB, image_id: 'docker:pytorch/pytorch:2.4'}\nrun: python train.py\n"
            "file_mounts:\n  /datasets: s3://acme-data/imagenet/\n  ~/vocab.txt: gs://acme-nlp/vocab.txt\n"
            "  /ckpt:\n    source: s3://acme-ckpt\n    mode: COPY\n")
    body = post(acme, task, dry_run=1).json()
    assert body["problems"] == []
    assert body["spec"]["files"] == [{"source": "s3://acme-data/imagenet/", "destination": "/datasets"},
                                     {"source": "gs://acme-nlp/vocab.txt", "destination": "~/vocab.txt"},
                                     {"source": "s3://acme-ckpt", "destination": "/ckpt"}]


def test_a_local_workdir_or_mount_must_come_through_the_cli_and_mount_modes_other_than_copy_are_problems(acme):
    task = ("resources: {accelerators: A100-80GB}\nrun: python train.py\nworkdir: .\n"
            "file_mounts:\n  ~/data: ./data\n  ~/ckpt:\n    source: s3://acme-ckpt\n    mode: MOUNT\n")
    body = post(acme, task, dry_run=1).json()
    problems = {p["field"]: p["message"] for p in body["problems"]}
    assert set(problems) == {"workdir", "file_mounts[~/data]", "file_mounts[~/ckpt].mode"}
    assert "whalezen submit" in problems["workdir"] and "only COPY" in problems["file_mounts[~/ckpt].mode"]
    refused = post(acme, task.replace("~/data", "~/data.v2"))
    assert refused.status_code == 400 and Job.objects.count() == 0
    assert set(refused.json()["file_mounts"]) == {"[~/data.v2]", "[~/ckpt]"}


@pytest.mark.parametrize("mounts, field, words", [
    ("  ~/x: https://example.com/x.tar", "file_mounts", "not https://"),
    ("  ~/x: r2://bucket/x", "file_mounts", "not r2://"),
    ("  ~/x: {name: new-bucket, mode: COPY}", "file_mounts", "Creating a bucket"),
    ("  /data: s3://acme-data", "files", "an absolute destination needs an image"),
    ("  ~/../etc: s3://acme-data", "files", "'..'"),
])
def test_mounts_we_cannot_provide_are_refused_by_field(acme, mounts, field, words):
    resp = post(acme, f"resources: {{accelerators: A100-80GB}}\nrun: x\nfile_mounts:\n{mounts}\n", dry_run=1)
    assert resp.status_code == 400, resp.content
    assert field in resp.json() and words in str(resp.json()[field])


def uploaded(world, files: dict[str, bytes]) -> str:
    """An upload through the API, as `whalezen submit` makes one of a workdir: its id."""
    resp = world.client.post("/api/v1/uploads/", data=archive(files), content_type="application/gzip")
    assert resp.status_code == 201, resp.content
    return resp.json()["id"]


def test_an_uploaded_workdir_is_where_setup_and_run_run(acme):
    upload = uploaded(acme, {"train.py": b"print(1)\n"})
    task = f"resources: {{accelerators: A100-80GB}}\nworkdir: upload:{upload}\nrun: python3 train.py\n"
    body = post(acme, task).json()
    assert body["spec"]["files"] == [{"source": f"upload:{upload}", "destination": "~/sky_workdir"}]
    assert body["spec"]["command"][2].startswith('cd "$HOME/sky_workdir" || exit 1\n')


def test_another_teams_upload_is_refused(acme, globex):
    theirs = uploaded(globex, {"a": b"b"})
    resp = post(acme, f"resources: {{accelerators: A100-80GB}}\nworkdir: upload:{theirs}\nrun: x\n")
    assert resp.status_code == 400 and "in this team" in str(resp.json()["files"]["[0]"]["source"])


def test_a_waiting_job_with_alternatives_says_what_each_would_need(acme):
    from broker.scheduler.services import scheduling_cycle_run

    resp = post(acme, "resources: {accelerators: {A100-80GB: 16, T4: 2}}\nrun: x\n")
    assert resp.status_code == 201, resp.content  # T4 is in no pool of acme's: a warning
    scheduling_cycle_run(tenant=acme.tenant)
    reason = acme.client.get(f"{URL}{resp.json()['id']}/").json()["pending_reason"]
    assert "A100-80GB:16" in reason["message"] and "T4:2" in reason["message"], reason
