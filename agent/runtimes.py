"""Container runtimes on this node, and the command line that runs a job's image through one.

A job with an `image` runs inside a container, never on the host. The agent looks for podman,
docker, apptainer and singularity on PATH at start (`--container-runtime` pins or disables them)
and tells the broker which it found; the engine places image jobs only on nodes that have one.

GPUs: podman and docker get exactly the job's GPUs through the NVIDIA container toolkit, with CDI
(`--device nvidia.com/gpu=<uuid or index>`) where NVIDIA's CDI spec exists, else `--gpus
'"device=..."'` (the toolkit's runtime hook); inside, CUDA numbers them from 0. Apptainer's `--nv`
shows every GPU, so CUDA_VISIBLE_DEVICES (the host indices, as for host jobs) selects the job's.

Secrets: the job's env values never appear on a command line (every user can read those in
/proc). podman and docker get `--env NAME` and read the value from their own environment;
apptainer reads `APPTAINERENV_NAME`. Names that would steer the runtime client itself (PATH,
LD_PRELOAD, DOCKER_HOST...) cannot be passed that way: the client runs as root for docker.

Who: docker's and rootful podman's clients talk to a root daemon (or are root), so the job user
never runs them (the docker socket is root for whoever can reach it); the container runs as the
job user (`--user UID:GID`) with no new privileges. Rootless podman maps the agent's own user in
(`--userns=keep-id`). Apptainer needs no privilege: it runs as the job user, like a host job.

Standard library only, like the rest of the agent.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

RUNTIME_NAMES = ("podman", "docker", "apptainer", "singularity")  # also the order of preference
OCI_RUNTIMES = ("podman", "docker")  # daemon-style: named containers, `--env NAME`, `kill`
RUNTIMES_ENV = "WHALEZEN_AGENT_CONTAINER_RUNTIMES"
AUTO, NONE = "auto", "none"
# Where NVIDIA's container toolkit writes CDI specs (`nvidia-ctk cdi generate`, or the toolkit's
# nvidia-cdi-refresh service). A spec means `--device nvidia.com/gpu=N` works.
CDI_SPEC_GLOBS = ("/etc/cdi/nvidia*.yaml", "/etc/cdi/nvidia*.json", "/var/run/cdi/nvidia*.yaml",
                  "/var/run/cdi/nvidia*.json")
# Without CDI, docker's `--gpus` needs the toolkit's runtime hook, which these binaries come with.
TOOLKIT_BINARIES = ("nvidia-container-runtime", "nvidia-ctk", "nvidia-container-runtime-hook")
PROBE_TIMEOUT_S = 10.0  # `docker info` against a daemon that is up answers in well under a second
CLEANUP_TIMEOUT_S = 20.0  # `docker rm -f` on a container that ignores SIGTERM: SIGKILL after its 10 s
CONTAINER_PREFIX = "whalezen-"

GPU_CDI, GPU_FLAG, GPU_NV, GPU_NONE = "cdi", "gpus", "nv", "none"
# Simulated GPUs (--fake-gpus, the demo): they exist only as the agent's numbers, so a podman or
# docker without the NVIDIA toolkit can run image jobs all the same; the container gets no GPU
# device, only CUDA_VISIBLE_DEVICES, as a host job on simulated GPUs does.
GPU_SIMULATED = "simulated"

# The distribution reference grammar (github.com/distribution/reference): [domain/]path[:tag][@digest].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_REFERENCE = re.compile(
    rf"(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?"
    r"(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}))?")
_SIF_PATH = re.compile(r"/[A-Za-z0-9._/+-]{1,4000}\.sif")
MAX_REFERENCE = 512
# Env names that change what the runtime client does (which binaries or credential helpers it
# runs, which daemon it talks to, what it loads): a job's value must never reach the client.
_CLIENT_NAMES = frozenset({"PATH", "HOME", "TMPDIR", "SHELL", "USER", "LOGNAME", "IFS", "ENV", "BASH_ENV",
                           "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "GODEBUG", "GOMAXPROCS", "GOGC",
                           "GOTRACEBACK"})
_CLIENT_PREFIXES = ("LD_", "DOCKER_", "CONTAINER", "PODMAN_", "BUILDAH_", "REGISTRY_", "XDG_", "SSL_")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class RuntimeSetupError(ValueError):
    """`--container-runtime` names something this node cannot use (a usage error at start)."""


class ImageInvalid(ValueError):
    pass


@dataclass(frozen=True)
class Runtime:
    name: str  # podman | docker | apptainer | singularity
    path: str  # the binary, absolute: PATH is looked up once, at start
    gpu_mode: str  # cdi | gpus | nv | none (cannot give a container GPUs)

    @property
    def oci(self) -> bool:
        return self.name in OCI_RUNTIMES


@dataclass(frozen=True)
class ContainerCommand:
    argv: list[str]
    env: dict[str, str]  # the runtime client's own environment (the job's values under their names)
    name: str | None  # the container's name, for `kill` / `rm -f`; None for apptainer (no daemon)
    run_as_job_user: bool  # the client itself runs as the job user (apptainer), else as the agent


# -- detection -----------------------------------------------------------------------------------
def parse_setting(text: str | None) -> tuple[str, ...] | None:
    """`--container-runtime`: None for `auto` (detect), () for `none`, else the pinned names in
    order of preference. Raises RuntimeSetupError for a name the agent does not know."""
    words = [w.strip().lower() for w in (text or "").split(",") if w.strip()]
    if not words or words == [AUTO]:
        return None
    if words == [NONE]:
        return ()
    unknown = [w for w in words if w not in RUNTIME_NAMES]
    if unknown or len(set(words)) != len(words):
        raise RuntimeSetupError(f"--container-runtime: expected auto, none or a comma-separated list of "
                                f"{', '.join(RUNTIME_NAMES)}; got {text!r}")
    return tuple(words)


def detect(setting: str | None = None, *, path: str | None = None,
           cdi_globs: Sequence[str] = CDI_SPEC_GLOBS, simulated_gpus: bool = False) -> tuple[Runtime, ...]:
    """The runtimes this node can run images with, in order of preference.

    Auto-detection skips a docker whose daemon does not answer and a podman/docker without the
    NVIDIA container toolkit (it could not give a job its GPUs); a pinned runtime must exist
    (RuntimeSetupError otherwise) and is kept without the toolkit (its GPU jobs are refused at
    start), since the admin said so. `path` replaces PATH for the lookup (tests)."""
    pinned = parse_setting(setting)
    found: list[Runtime] = []
    for name in RUNTIME_NAMES if pinned is None else pinned:
        binary = shutil.which(name, path=path)
        if binary is None:
            if pinned is not None:
                raise RuntimeSetupError(f"--container-runtime {name}: no {name} on PATH")
            continue
        binary = os.path.abspath(binary)
        if name in OCI_RUNTIMES:
            mode = _oci_gpu_mode(path=path, cdi_globs=cdi_globs)
            if mode == GPU_NONE and simulated_gpus:
                mode = GPU_SIMULATED
            if name == "docker" and not _daemon_answers(binary):
                if pinned is not None:
                    raise RuntimeSetupError(f"--container-runtime docker: {binary} found, but its daemon does not "
                                            "answer (`docker info` failed)")
                log.warning("found %s, but the docker daemon does not answer: not using it", binary)
                continue
            if mode == GPU_NONE and pinned is None:
                log.warning("found %s, but no NVIDIA container toolkit (no CDI spec in /etc/cdi or /var/run/cdi, no "
                            "nvidia-ctk): its containers could not get GPUs, so it is not used; install "
                            "nvidia-container-toolkit, or pin it with --container-runtime %s", binary, name)
                continue
        else:
            mode = GPU_NV
        found.append(Runtime(name=name, path=binary, gpu_mode=mode))
    return tuple(found)


def _oci_gpu_mode(*, path: str | None, cdi_globs: Sequence[str]) -> str:
    if any(glob.glob(pattern) for pattern in cdi_globs):
        return GPU_CDI
    if any(shutil.which(tool, path=path) for tool in TOOLKIT_BINARIES):
        return GPU_FLAG
    return GPU_NONE


def _daemon_answers(binary: str) -> bool:
    try:
        done = subprocess.run([binary, "info", "--format", "{{.ServerVersion}}"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and bool(done.stdout.strip())


def log_runtimes(runtimes: Sequence[Runtime]) -> None:
    if runtimes:
        log.info("container runtimes: %s", ", ".join(f"{r.name} ({r.path}, GPUs: {r.gpu_mode})" for r in runtimes))
    else:
        log.info("no container runtime: jobs with an image are refused on this node")


# -- images --------------------------------------------------------------------------------------
def image_reference(text: object) -> str:
    """The image a job asked for, checked: a registry reference (`docker:` / `docker://`, SkyPilot's
    `image_id` prefix, is dropped) or an absolute path to a .sif file (apptainer only).
    Raises ImageInvalid: what reaches a command line here must never read as an option."""
    if not isinstance(text, str) or not text.strip():
        raise ImageInvalid("image must be a non-empty string")
    ref = text.strip()
    for prefix in ("docker://", "docker:"):
        if ref.startswith(prefix):
            ref = ref[len(prefix):]
            break
    if len(ref) > MAX_REFERENCE:
        raise ImageInvalid(f"image reference longer than {MAX_REFERENCE} characters")
    if ref.startswith("/"):
        if not _SIF_PATH.fullmatch(ref) or "/../" in ref or "/./" in ref:
            raise ImageInvalid("an image path must be an absolute path to a .sif file")
        return ref
    match = _REFERENCE.fullmatch(ref)
    if match is None:
        raise ImageInvalid(f"not an image reference (registry/name:tag or name@sha256:...): {ref[:80]!r}")
    domain = match.group("domain")
    if domain and not any(c in domain for c in ".:[") and domain != "localhost" and not re.fullmatch(_COMPONENT, domain):
        # Without a dot or port it is no registry but the first part of a Docker Hub name: lower case.
        raise ImageInvalid(f"repository names are lower case: {ref[:80]!r}")
    return ref


def _qualified(ref: str) -> str:
    """docker.io for a short name, as docker resolves it: podman's short-name policy otherwise asks
    on a terminal (there is none) or refuses."""
    first, slash, _ = ref.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        return ref
    return f"docker.io/{ref}" if slash else f"docker.io/library/{ref}"


# -- the command line ----------------------------------------------------------------------------
def container_name(assignment_id: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in assignment_id)
    return CONTAINER_PREFIX + (cleaned.strip("._-") or "assignment")


def client_steering(name: str) -> bool:
    """Whether an env name would change what the runtime client does (see the module docstring)."""
    upper = name.upper()
    return upper in _CLIENT_NAMES or upper.startswith(_CLIENT_PREFIXES)


def container_command(
    runtime: Runtime, *, image: str, command: Sequence[str], job_env: Mapping[str, str],
    client_env: Mapping[str, str], workdir: Path, assignment_id: str, gpu_indices: Sequence[int],
    gpu_uuids: Sequence[str] | None, uid: int, gid: int, agent_is_root: bool,
    mounts: Sequence[tuple[str, str]] = (),
) -> ContainerCommand:
    """The argv (and the client's environment) that runs `command` in `image` with the job's GPUs.

    `job_env`: what the job sees (its own env and the agent's WHALEZEN_* / CUDA_* variables);
    `client_env`: the agent's sanitised environment, for the runtime binary itself. An empty
    `command` runs the image's own entrypoint; a command replaces it (as a Kubernetes `command`
    does). `mounts`: (host path, container path) pairs bind-mounted read-write (the job's files
    with absolute destinations, agent/jobfiles.py). Raises ImageInvalid for a .sif path given to
    podman/docker, and ValueError for GPUs a runtime without the NVIDIA toolkit cannot give."""
    if gpu_indices and runtime.gpu_mode == GPU_NONE:
        raise ValueError(f"{runtime.name} on this node has no NVIDIA container toolkit (no CDI spec, no nvidia-ctk): "
                         "it cannot give the job its GPUs")
    bad = [k for k in job_env if not _ENV_NAME.fullmatch(k)]
    if bad:
        raise ValueError(f"env name {bad[0][:40]!r} cannot be passed into a container")
    if runtime.oci:
        return _oci_command(runtime, image=image, command=command, job_env=job_env, client_env=client_env,
                            workdir=workdir, assignment_id=assignment_id, gpu_indices=gpu_indices,
                            gpu_uuids=gpu_uuids, uid=uid, gid=gid, agent_is_root=agent_is_root, mounts=mounts)
    return _apptainer_command(runtime, image=image, command=command, job_env=job_env, client_env=client_env,
                              workdir=workdir, mounts=mounts)


def _gpu_ids(gpu_indices: Sequence[int], gpu_uuids: Sequence[str] | None) -> list[str]:
    # UUIDs when the broker sent them (it does only for real GPUs): they name the same GPU whatever
    # the numbering; indices otherwise (fake GPUs too: the flags still name exactly the job's).
    return list(gpu_uuids) if gpu_uuids else [str(i) for i in gpu_indices]


def _oci_command(
    runtime: Runtime, *, image: str, command: Sequence[str], job_env: Mapping[str, str],
    client_env: Mapping[str, str], workdir: Path, assignment_id: str, gpu_indices: Sequence[int],
    gpu_uuids: Sequence[str] | None, uid: int, gid: int, agent_is_root: bool, mounts: Sequence[tuple[str, str]] = (),
) -> ContainerCommand:
    if image.startswith("/"):
        raise ImageInvalid(f"{runtime.name} cannot run a .sif file; it needs a registry image")
    name = container_name(assignment_id)
    wd = str(workdir)
    argv = [runtime.path, "run", "--rm", "--name", name, "--init", "--pull", "missing",
            "--volume", f"{wd}:{wd}", "--workdir", wd, "--security-opt", "no-new-privileges"]
    for host, inside_path in mounts:
        argv += ["--volume", f"{host}:{inside_path}"]
    if runtime.name == "podman":
        # SELinux would deny the container the GPU device nodes and the mounted work dir.
        argv += ["--security-opt", "label=disable"]
    if runtime.name == "podman" and not agent_is_root:
        argv += ["--userns=keep-id"]  # rootless: the host user is the container user, the mount is theirs
    else:
        argv += ["--user", f"{uid}:{gid}"]
    ids = _gpu_ids(gpu_indices, gpu_uuids)
    if ids and runtime.gpu_mode == GPU_CDI:
        for gpu in ids:
            argv += ["--device", f"nvidia.com/gpu={gpu}"]
    elif ids and runtime.gpu_mode != GPU_SIMULATED:
        argv += ["--gpus", f'"device={",".join(ids)}"']  # docker's CSV syntax: the quotes keep the commas
    env = dict(client_env)
    inside = _without_gpu_selectors(job_env, assignment_id)
    # The container sees only the job's GPUs, numbered from 0: the host's indices would name GPUs
    # it does not have.
    inside["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(gpu_indices)))
    inside.setdefault("HOME", wd)  # the image's HOME is not the job user's (often / or /root)
    for key in sorted(inside):
        value = inside[key]
        if not client_steering(key):
            env[key] = value
            argv += ["--env", key]  # the value comes from the client's environment, never the command line
            continue
        if key in job_env:
            # The job's own value under a name the client reads itself (PATH, LD_*...): only the
            # command line can carry it past the client. docs/agent.md: no secrets under these names.
            log.warning("assignment %s: env %s is passed on the container's command line (%s reads that name "
                        "itself)", assignment_id, key, runtime.name)
        argv += ["--env", f"{key}={value}"]
    ref = _qualified(image) if runtime.name == "podman" else image
    argv += ["--entrypoint", command[0], ref, *command[1:]] if command else [ref]
    return ContainerCommand(argv=argv, env=env, name=name, run_as_job_user=False)


def _without_gpu_selectors(job_env: Mapping[str, str], assignment_id: str | None) -> dict[str, str]:
    """The job's env less NVIDIA_* names: the toolkit reads NVIDIA_VISIBLE_DEVICES from the
    container's env, so `NVIDIA_VISIBLE_DEVICES=all` would hand the job every GPU of the node."""
    kept = {}
    for key, value in job_env.items():
        if key.upper().startswith("NVIDIA_"):
            log.warning("assignment %s: ignoring env %s, the container runtime sets the GPUs", assignment_id, key)
            continue
        kept[key] = value
    return kept


def _apptainer_command(
    runtime: Runtime, *, image: str, command: Sequence[str], job_env: Mapping[str, str],
    client_env: Mapping[str, str], workdir: Path, mounts: Sequence[tuple[str, str]] = (),
) -> ContainerCommand:
    wd = str(workdir)
    source = image if image.startswith("/") or "://" in image else f"docker://{image}"
    prefix = "APPTAINERENV_" if runtime.name == "apptainer" else "SINGULARITYENV_"
    # --cleanenv: the host's environment (its PATH, the agent's) stays out; only <prefix>NAME
    # variables go in. --contain: no host /tmp or home; the work dir is the job's home and cwd.
    argv = [runtime.path, "exec" if command else "run", "--contain", "--cleanenv", "--home", f"{wd}:{wd}",
            "--pwd", wd]
    for host, inside_path in mounts:
        argv += ["--bind", f"{host}:{inside_path}"]
    if runtime.gpu_mode == GPU_NV and "CUDA_VISIBLE_DEVICES" in job_env and job_env["CUDA_VISIBLE_DEVICES"]:
        argv.append("--nv")
    env = {k: v for k, v in client_env.items() if not k.startswith(("APPTAINERENV_", "SINGULARITYENV_"))}
    for key, value in _without_gpu_selectors(job_env, None).items():
        if key == "HOME":
            continue  # apptainer refuses HOME this way; --home sets it
        env[prefix + key] = value
    argv += [source, *command]
    return ContainerCommand(argv=argv, env=env, name=None, run_as_job_user=True)


# -- cleanup -------------------------------------------------------------------------------------
def remove_container(runtimes: Iterable[Runtime], name: str) -> None:
    """`rm -f` the named container wherever it may be: a container outlives a killed `docker run`
    client (the daemon owns it), so a stop that ended only the client would leave the job running.
    Quiet when there is none (the usual case: `--rm` removed it when it ended)."""
    for runtime in runtimes:
        if not runtime.oci:
            continue
        try:
            subprocess.run([runtime.path, "rm", "--force", name], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=CLEANUP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            log.warning("could not remove container %s with %s: %s", name, runtime.name, err)
