"""A real podman for the tests that run container images, with an image built here, offline.

The image is busybox (Debian's `busybox-static`, one static binary) imported as a rootfs with
`podman import`: no registry is reachable from the test machines, and busybox is enough to prove
what a container changes (the filesystem, the user, the environment, PID 1, signals).

Some hosts (this project's CI sandbox among them) refuse podman's defaults: rootful podman raises
RLIMIT_NOFILE and RLIMIT_NPROC above the host's hard limits (EPERM without CAP_SYS_RESOURCE), and
crun refuses hybrid cgroup v1/v2 hosts where runc works. `podman_or_skip` writes a containers.conf
that keeps the limits within the host's and picks the OCI runtime that can start a container
here, and hands it over as CONTAINERS_CONF (podman's documented override), so nothing on the host
is changed. The agent passes its own environment to the runtime client, so an agent started with
`Podman.env` uses it too.
"""
from __future__ import annotations

import fcntl
import io
import os
import resource
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

IMAGE = "localhost/whalezen-test-busybox:1"
APPLETS = ("sh", "cat", "echo", "env", "id", "sleep", "ls", "printf", "tr", "true", "false", "test", "grep")
CONF_DIR = Path(tempfile.gettempdir()) / "whalezen-test-podman"
TIMEOUT_S = 120.0  # a first podman call sets up its storage: seconds, not minutes


@dataclass(frozen=True)
class Podman:
    binary: str
    conf: Path
    image: str = IMAGE

    @property
    def env(self) -> dict[str, str]:
        """What a process that runs podman (the agent) needs in its environment."""
        return {"CONTAINERS_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.binary, *args], env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=check, stdin=subprocess.DEVNULL)

    def containers(self, name: str) -> list[str]:
        """The names of the containers, running or not, whose name contains `name`."""
        done = self.run("ps", "--all", "--filter", f"name={name}", "--format", "{{.Names}}", check=True)
        return done.stdout.split()


def podman_or_skip() -> Podman:
    """A podman that can run `IMAGE` here, or a skip that says what is missing (`.ci/run` installs
    podman, runc, catatonit and busybox-static, so CI never skips: its services pass fails on any skip)."""
    podman, problem = find_podman()
    if podman is None:
        pytest.skip(problem)
    return podman


def find_podman() -> tuple[Podman | None, str]:
    """(a podman that can run `IMAGE` here, "") or (None, why not)."""
    binary = shutil.which("podman")
    busybox = shutil.which("busybox")
    if binary is None or busybox is None:
        return None, ("needs podman and a static busybox (apt-get install podman runc catatonit busybox-static; "
                      ".ci/run does)")
    CONF_DIR.mkdir(parents=True, exist_ok=True)
    conf = CONF_DIR / "containers.conf"
    with open(CONF_DIR / "lock", "w") as lock:  # xdist workers build the image once, one at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        problem = _configure(binary, conf, Path(busybox))
    if problem:
        return None, f"podman is installed but cannot run a container here: {problem}"
    return Podman(binary=binary, conf=conf), ""


def _configure(binary: str, conf: Path, busybox: Path) -> str | None:
    """Make `conf` a containers.conf that runs `IMAGE` here (None), or say why none does. A conf
    that works is kept: other test processes may be running podman with it."""
    if conf.exists() and _ready(binary, conf, busybox) is None:
        return None
    ulimits = ", ".join(f'"{name}={value}:{value}"' for name, value in _ulimits().items())
    problem = "no OCI runtime (crun or runc)"
    for runtime in (None, "crun", "runc"):
        if runtime and shutil.which(runtime) is None:
            continue
        engine = f'[engine]\nruntime = "{runtime}"\n' if runtime else ""
        draft = conf.with_suffix(".draft")
        draft.write_text(f"[containers]\ndefault_ulimits = [{ulimits}]\n{engine}")
        problem = _ready(binary, draft, busybox)
        if problem is None:
            os.replace(draft, conf)
            return None
    return problem


def _ready(binary: str, conf: Path, busybox: Path) -> str | None:
    """None when podman with `conf` runs `IMAGE` (imported first if missing), else its complaint."""
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    if _run(binary, ["image", "exists", IMAGE], env).returncode != 0:
        built = subprocess.run([binary, "import", "--change", "ENV PATH=/bin", "-", IMAGE],
                               input=_rootfs(busybox), env=env, capture_output=True, timeout=TIMEOUT_S)
        if built.returncode != 0:
            return f"podman import: {built.stderr.decode(errors='replace').strip()[-300:]}"
    probe = _run(binary, ["run", "--rm", "--init", IMAGE, "/bin/sh", "-c", "echo ok"], env)
    if probe.returncode == 0 and probe.stdout.strip() == "ok":
        return None
    return probe.stderr.strip()[-300:] or f"exit code {probe.returncode}"


def _ulimits() -> dict[str, int]:
    """Limits no higher than this process's hard ones (podman's own defaults may be)."""
    limits = {}
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if nofile != resource.RLIM_INFINITY:
        limits["nofile"] = nofile
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    # runc sets NPROC from podman's conmon, whose own limit can sit below ours: 4096 is plenty here.
    limits["nproc"] = 4096 if nproc == resource.RLIM_INFINITY else min(nproc, 4096)
    return limits


def _run(binary: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary, *args], env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def _rootfs(busybox: Path) -> bytes:
    """A tarball of `/bin/busybox`, its applets as symlinks, and the folders a container needs."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for folder in ("bin", "tmp", "etc", "proc", "sys", "dev"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if folder == "tmp" else 0o755
            tar.addfile(info)
        tar.add(busybox, arcname="bin/busybox")
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname, link.mode = tarfile.SYMTYPE, "busybox", 0o777
            tar.addfile(link)
        passwd = b"root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size, info.mode = len(passwd), 0o644
        tar.addfile(info, io.BytesIO(passwd))
    return buffer.getvalue()
