"""Container runtimes: what the agent detects, and the command line it builds for an image job.

No real podman/docker/apptainer runs here: detection looks at stand-ins (tests/agent/runtime_standin.py)
on a PATH of the test's own; argv is checked as built.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from agent import runtimes
from agent.jobs import Assignment, AssignmentInvalid
from agent.runtimes import GPU_CDI, GPU_FLAG, GPU_NONE, GPU_NV, Runtime, RuntimeSetupError, container_command, detect
from tests.agent import runtime_standin

SECRET = "hf_s3cr3t-value-never-on-a-command-line"


def cdi_glob(tmp_path: Path, *, present: bool) -> list[str]:
    folder = tmp_path / "cdi"
    folder.mkdir(exist_ok=True)
    if present:
        (folder / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n")
    return [str(folder / "nvidia*.yaml")]


# -- detection -----------------------------------------------------------------------------------
def test_auto_detection_finds_each_runtime_in_order_of_preference(tmp_path):
    standin = runtime_standin.install(tmp_path, "apptainer", "docker", "podman")
    found = detect(None, path=str(standin.bin_dir), cdi_globs=cdi_glob(tmp_path, present=False))
    assert [(r.name, r.gpu_mode) for r in found] == [("podman", GPU_FLAG), ("docker", GPU_FLAG), ("apptainer", GPU_NV)]
    assert all(Path(r.path).is_absolute() and Path(r.path).parent == standin.bin_dir for r in found)


def test_an_nvidia_cdi_spec_makes_podman_and_docker_use_cdi_devices(tmp_path):
    standin = runtime_standin.install(tmp_path, "docker", "podman", toolkit=False)
    found = detect("auto", path=str(standin.bin_dir), cdi_globs=cdi_glob(tmp_path, present=True))
    assert [(r.name, r.gpu_mode) for r in found] == [("podman", GPU_CDI), ("docker", GPU_CDI)]


def test_a_runtime_without_the_nvidia_toolkit_is_not_used_unless_pinned(tmp_path):
    standin = runtime_standin.install(tmp_path, "docker", toolkit=False)
    no_cdi = cdi_glob(tmp_path, present=False)
    assert detect(None, path=str(standin.bin_dir), cdi_globs=no_cdi) == ()
    (pinned,) = detect("docker", path=str(standin.bin_dir), cdi_globs=no_cdi)
    assert pinned.gpu_mode == GPU_NONE
    with pytest.raises(ValueError, match="no NVIDIA container toolkit"):
        container_command(pinned, image="ubuntu", command=["true"], job_env={}, client_env={}, workdir=tmp_path,
                          assignment_id="a1", gpu_indices=[0], gpu_uuids=None, uid=65534, gid=65534,
                          agent_is_root=True)


def test_on_simulated_gpus_a_runtime_without_the_toolkit_runs_images_without_gpu_devices(tmp_path):
    # The demo (make run): its GPUs exist only as the agent's numbers, so podman needs no toolkit.
    standin = runtime_standin.install(tmp_path, "podman", toolkit=False)
    no_cdi = cdi_glob(tmp_path, present=False)
    assert detect(None, path=str(standin.bin_dir), cdi_globs=no_cdi) == ()  # real GPUs: not usable
    (podman,) = detect(None, path=str(standin.bin_dir), cdi_globs=no_cdi, simulated_gpus=True)
    assert podman.gpu_mode == runtimes.GPU_SIMULATED
    run = build(podman, tmp_path)
    assert "--gpus" not in run.argv and "--device" not in run.argv
    assert pairs(run.argv, "--env").count("CUDA_VISIBLE_DEVICES") == 1


def test_a_docker_whose_daemon_does_not_answer_is_not_a_runtime(tmp_path):
    standin = runtime_standin.install(tmp_path, "docker", daemon_up=False)
    assert detect(None, path=str(standin.bin_dir)) == ()
    assert standin.records("info"), "the daemon was asked"
    with pytest.raises(RuntimeSetupError, match="daemon does not answer"):
        detect("docker", path=str(standin.bin_dir))


def test_pinning_chooses_and_orders_and_none_disables(tmp_path):
    standin = runtime_standin.install(tmp_path, "apptainer", "docker", "podman")
    path = str(standin.bin_dir)
    assert [r.name for r in detect("apptainer,docker", path=path)] == ["apptainer", "docker"]
    assert detect("none", path=path) == ()
    assert detect(" NONE ", path=path) == ()


@pytest.mark.parametrize("setting, fragment", [
    ("kubernetes", "expected auto, none or"),
    ("docker,docker", "expected auto, none or"),
    ("singularity", "no singularity on PATH"),
])
def test_a_bad_pin_is_a_usage_error(tmp_path, setting, fragment):
    standin = runtime_standin.install(tmp_path, "docker")
    with pytest.raises(RuntimeSetupError, match=fragment):
        detect(setting, path=str(standin.bin_dir))


# -- images --------------------------------------------------------------------------------------
@pytest.mark.parametrize("given, kept", [
    ("nvcr.io/nvidia/pytorch:24.05-py3", "nvcr.io/nvidia/pytorch:24.05-py3"),
    ("docker:pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime", "pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime"),
    ("docker://ubuntu:22.04", "ubuntu:22.04"),
    ("localhost:5000/team/trainer@sha256:" + "ab" * 32, "localhost:5000/team/trainer@sha256:" + "ab" * 32),
    ("/shared/images/trainer.sif", "/shared/images/trainer.sif"),
])
def test_image_references_are_accepted_with_the_skypilot_prefix_dropped(given, kept):
    a = Assignment.from_json({"id": "a1", "job_id": "j1", "epoch": 1, "image": given, "gpu_indices": [0]})
    assert a.image == kept and a.command == ()  # no command: the image's own entrypoint


@pytest.mark.parametrize("image", ["--privileged", "-v/:/host", "ubuntu latest", "Ubuntu", "ubuntu:", "x;id",
                                   "/etc/passwd", "/a/../b.sif", 42, "a" * 600])
def test_an_image_that_is_no_reference_makes_the_assignment_invalid(image):
    with pytest.raises(AssignmentInvalid):
        Assignment.from_json({"id": "a1", "job_id": "j1", "epoch": 1, "image": image, "command": ["true"]})


# -- the command line ----------------------------------------------------------------------------
def build(runtime: Runtime, tmp_path: Path, **overrides):
    args = dict(image="nvcr.io/nvidia/pytorch:24.05-py3", command=["python", "train.py", "--epochs", "3"],
                job_env={"HF_TOKEN": SECRET, "WHALEZEN_JOB_ID": "j1", "CUDA_VISIBLE_DEVICES": "2,5",
                         "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
                client_env={"PATH": "/usr/bin:/bin", "HOME": "/root"}, workdir=tmp_path / "a1",
                assignment_id="a1", gpu_indices=[2, 5], gpu_uuids=None, uid=65534, gid=65534, agent_is_root=True)
    args.update(overrides)
    return container_command(runtime, **args)


def pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag]


def test_docker_with_cdi_names_exactly_the_jobs_gpus_by_uuid(tmp_path):
    docker = Runtime("docker", "/usr/bin/docker", GPU_CDI)
    run = build(docker, tmp_path, gpu_uuids=["GPU-aaaa", "GPU-bbbb"])
    assert pairs(run.argv, "--device") == ["nvidia.com/gpu=GPU-aaaa", "nvidia.com/gpu=GPU-bbbb"]
    assert "--gpus" not in run.argv
    wd = str(tmp_path / "a1")
    assert run.argv[:3] == ["/usr/bin/docker", "run", "--rm"] and run.name == "whalezen-a1"
    assert pairs(run.argv, "--name") == ["whalezen-a1"]
    assert pairs(run.argv, "--volume") == [f"{wd}:{wd}"] and pairs(run.argv, "--workdir") == [wd]
    assert pairs(run.argv, "--user") == ["65534:65534"] and "--init" in run.argv
    assert run.argv[-4:] == ["nvcr.io/nvidia/pytorch:24.05-py3", "train.py", "--epochs", "3"]
    assert pairs(run.argv, "--entrypoint") == ["python"]
    assert not run.run_as_job_user  # docker's socket is root: the job user never holds it


def test_docker_without_cdi_uses_the_gpus_flag_with_the_jobs_indices(tmp_path):
    run = build(Runtime("docker", "/usr/bin/docker", GPU_FLAG), tmp_path)
    assert pairs(run.argv, "--gpus") == ['"device=2,5"'] and "--device" not in run.argv


def test_podman_gets_cdi_devices_a_qualified_image_and_keeps_the_agents_user_when_rootless(tmp_path):
    podman = Runtime("podman", "/usr/bin/podman", GPU_CDI)
    rootful = build(podman, tmp_path, image="ubuntu:22.04", command=[])
    assert pairs(rootful.argv, "--device") == ["nvidia.com/gpu=2", "nvidia.com/gpu=5"]
    assert rootful.argv[-1] == "docker.io/library/ubuntu:22.04" and "--entrypoint" not in rootful.argv
    assert pairs(rootful.argv, "--user") == ["65534:65534"] and "label=disable" in rootful.argv
    rootless = build(podman, tmp_path, agent_is_root=False)
    assert "--userns=keep-id" in rootless.argv and "--user" not in rootless.argv


def test_env_values_never_reach_the_command_line(tmp_path):
    for runtime in (Runtime("docker", "/usr/bin/docker", GPU_CDI), Runtime("podman", "/usr/bin/podman", GPU_FLAG),
                    Runtime("apptainer", "/usr/bin/apptainer", GPU_NV)):
        run = build(runtime, tmp_path)
        assert not any(SECRET in word for word in run.argv), runtime.name
        assert SECRET in run.env.values(), runtime.name
    oci = build(Runtime("docker", "/usr/bin/docker", GPU_CDI), tmp_path)
    assert "HF_TOKEN" in pairs(oci.argv, "--env") and oci.env["HF_TOKEN"] == SECRET
    # Inside, CUDA counts the container's GPUs from 0; the client keeps the agent's PATH and HOME.
    assert oci.env["CUDA_VISIBLE_DEVICES"] == "0,1" and oci.env["PATH"] == "/usr/bin:/bin"
    assert f"HOME={tmp_path / 'a1'}" in pairs(oci.argv, "--env")


def test_a_job_cannot_steer_the_runtime_client_or_pick_other_gpus(tmp_path):
    run = build(Runtime("docker", "/usr/bin/docker", GPU_CDI), tmp_path,
                job_env={"PATH": "/opt/conda/bin:/usr/bin", "LD_PRELOAD": "/tmp/x.so", "NVIDIA_VISIBLE_DEVICES": "all",
                         "DOCKER_HOST": "tcp://elsewhere:2375"})
    # The client (root, for docker) runs with the agent's own values of these names ...
    assert run.env["PATH"] == "/usr/bin:/bin" and "LD_PRELOAD" not in run.env and "DOCKER_HOST" not in run.env
    # ... the container gets the job's, as literals, and never a wider GPU selection.
    assert "PATH=/opt/conda/bin:/usr/bin" in pairs(run.argv, "--env")
    assert "LD_PRELOAD=/tmp/x.so" in pairs(run.argv, "--env")
    assert not any("NVIDIA_VISIBLE_DEVICES" in word for word in run.argv) and "NVIDIA_VISIBLE_DEVICES" not in run.env


def test_apptainer_runs_as_the_job_user_with_nv_and_the_host_gpu_indices(tmp_path):
    run = build(Runtime("apptainer", "/usr/bin/apptainer", GPU_NV), tmp_path, image="pytorch/pytorch:2.3")
    wd = str(tmp_path / "a1")
    assert run.argv[:2] == ["/usr/bin/apptainer", "exec"] and "--nv" in run.argv and "--cleanenv" in run.argv
    assert pairs(run.argv, "--pwd") == [wd] and pairs(run.argv, "--home") == [f"{wd}:{wd}"]
    assert run.argv[-5:] == ["docker://pytorch/pytorch:2.3", "python", "train.py", "--epochs", "3"]
    # --nv shows every GPU: CUDA_VISIBLE_DEVICES (host numbering) selects the job's.
    assert run.env["APPTAINERENV_CUDA_VISIBLE_DEVICES"] == "2,5" and run.env["APPTAINERENV_HF_TOKEN"] == SECRET
    assert run.run_as_job_user and run.name is None
    sif = build(Runtime("singularity", "/usr/bin/singularity", GPU_NV), tmp_path, image="/images/t.sif", command=[])
    assert sif.argv[1] == "run" and sif.argv[-1] == "/images/t.sif" and "SINGULARITYENV_HF_TOKEN" in sif.env


def test_a_sif_file_is_refused_by_docker(tmp_path):
    with pytest.raises(runtimes.ImageInvalid, match="cannot run a .sif"):
        build(Runtime("docker", "/usr/bin/docker", GPU_CDI), tmp_path, image="/images/t.sif")
