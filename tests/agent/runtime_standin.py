"""A recording stand-in for podman, docker and apptainer, for machines that have none that runs.

`install(bin_dir, "docker", ...)` writes an executable `bin_dir/docker` that appends one JSON line
per call to `records.jsonl` (its argv, the names in its environment, its uid) and then behaves like
the runtime closely enough for the agent to be tested against it for real:

- `docker|podman info`: answers a server version (or fails, with `daemon_up=False`).
- `docker|podman run [options] IMAGE [ARGS]`: runs the container's command on the host, with only
  the environment a container would get (the `--env` names, read from its own environment, and
  `--env NAME=VALUE`), in `--workdir`, as `--user`. As with a daemon, the "container" process is
  not the client's: it runs in a session of its own, so killing the client leaves it running
  until `rm --force NAME` (or `kill NAME`). The client passes SIGTERM/SIGINT/SIGUSR1 on (docker's
  --sig-proxy) and exits with the container's status (128+N for a signal, as docker does).
- `apptainer|singularity exec|run [options] IMAGE [ARGS]`: execs the command in place (apptainer's
  starter stays in the caller's process tree), with `--cleanenv` keeping only `APPTAINERENV_*` /
  `SINGULARITYENV_*` variables (prefix dropped), in `--pwd`, HOME from `--home`.

Without ARGS, `run` plays the image's entrypoint: it prints `entrypoint of IMAGE` and exits 0.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.agent.jobscripts import PY

SCRIPT = r'''#!{python} -I
import json, os, signal, sys, time
RECORDS = {records!r}
CONTAINERS = {containers!r}
DAEMON_UP = {daemon_up!r}
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
name = os.path.basename(sys.argv[0])
args = sys.argv[1:]


def record(**extra):
    with open(RECORDS, "a") as handle:
        handle.write(json.dumps({{"runtime": name, "argv": sys.argv, "env_names": sorted(os.environ),
                                 "uid": os.getuid(), **extra}}) + "\n")


def options(words, with_value, flags):
    """Leading options as a list of (option, value), then the rest (IMAGE ARGS...)."""
    found, i = [], 0
    while i < len(words) and words[i].startswith("-"):
        word = words[i]
        if "=" in word and word.split("=", 1)[0] in with_value:
            found.append(tuple(word.split("=", 1)))
        elif word in with_value:
            i += 1
            found.append((word, words[i]))
        elif word in flags:
            found.append((word, None))
        else:
            print(f"{{name}}: unknown flag: {{word}}", file=sys.stderr)
            sys.exit(125)
        i += 1
    return found, words[i:]


def command_of(image, entrypoint, rest):
    if entrypoint:
        return [entrypoint, *rest]
    if rest:
        return rest
    return ["/bin/sh", "-c", "echo entrypoint of " + image]


def oci_run(words):
    opts, rest = options(words, {{"--name", "--volume", "-v", "--workdir", "-w", "--env", "-e", "--user", "-u",
                                  "--device", "--gpus", "--security-opt", "--pull", "--entrypoint", "--userns"}},
                         {{"--rm", "--init"}})
    if not rest:
        print(f"{{name}}: run needs an image", file=sys.stderr)
        sys.exit(125)
    image, rest = rest[0], rest[1:]
    get = lambda key: [v for k, v in opts if k == key]
    env = {{"PATH": IMAGE_PATH, "HOSTNAME": "container"}}
    for item in get("--env") + get("-e"):
        key, sep, value = item.partition("=")
        if sep:
            env[key] = value
        elif key in os.environ:
            env[key] = os.environ[key]
    container = (get("--name") or ["anonymous"])[0]
    workdir = (get("--workdir") or ["/"])[0]
    user = (get("--user") or [None])[0]
    command = command_of(image, (get("--entrypoint") or [None])[0], rest)
    record(action="run", image=image, container=container, command=command)
    child = os.fork()
    if child == 0:
        os.setsid()  # the daemon's: not in the client's process group
        os.chdir(workdir)
        if user and os.getuid() == 0:
            uid, _, gid = user.partition(":")
            os.setgroups([])
            os.setgid(int(gid or uid))
            os.setuid(int(uid))
        os.execvpe(command[0], command, env)
    pid_file = os.path.join(CONTAINERS, container + ".pid")
    with open(pid_file, "w") as handle:
        handle.write(str(child))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, lambda s, f: os.kill(child, s))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    os.unlink(pid_file)
    sys.exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def oci_remove(words):
    target = [w for w in words if not w.startswith("-")][0]
    pid_file = os.path.join(CONTAINERS, target + ".pid")
    record(action="remove", container=target)
    try:
        pid = int(open(pid_file).read())
    except (OSError, ValueError):
        print(f"Error: No such container: {{target}}", file=sys.stderr)
        sys.exit(1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.unlink(pid_file)
    print(target)


def apptainer(words):
    verb, words = words[0], words[1:]
    opts, rest = options(words, {{"--home", "--pwd", "--bind", "-B"}}, {{"--contain", "--cleanenv", "--nv"}})
    image, rest = rest[0], rest[1:]
    get = lambda key: [v for k, v in opts if k == key]
    prefix = "APPTAINERENV_" if name == "apptainer" else "SINGULARITYENV_"
    if ("--cleanenv", None) in opts:
        env = {{"PATH": IMAGE_PATH}}
    else:
        env = dict(os.environ)
    env.update({{k[len(prefix):]: v for k, v in os.environ.items() if k.startswith(prefix)}})
    home = (get("--home") or [None])[0]
    if home:
        env["HOME"] = home.split(":")[-1]
    command = command_of(image, None, rest) if verb == "run" or rest else []
    record(action=verb, image=image, command=command)
    os.chdir((get("--pwd") or ["/"])[0])
    os.execvpe(command[0], command, env)


if name in ("docker", "podman"):
    if args[:1] == ["info"]:
        record(action="info")
        if DAEMON_UP:
            print("28.0.0")
            sys.exit(0)
        print("Cannot connect to the Docker daemon", file=sys.stderr)
        sys.exit(1)
    if args[:1] == ["run"]:
        oci_run(args[1:])
    elif args[:1] in (["rm"], ["kill"]):
        oci_remove(args[1:])
    else:
        sys.exit(125)
else:
    apptainer(args)
'''


@dataclass
class StandIn:
    bin_dir: Path
    records_file: Path
    containers_dir: Path

    def records(self, action: str | None = None) -> list[dict[str, Any]]:
        if not self.records_file.exists():
            return []
        lines = [json.loads(line) for line in self.records_file.read_text().splitlines() if line.strip()]
        return [r for r in lines if action is None or r.get("action") == action]


def install(root: Path, *names: str, daemon_up: bool = True, toolkit: bool = True) -> StandIn:
    """Stand-ins for `names` in `root/bin` (plus `nvidia-ctk` when `toolkit`), all readable and
    runnable by the job user: apptainer runs as that user, and records from there too."""
    bin_dir, containers = root / "bin", root / "containers"
    for folder in (bin_dir, containers):
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777)
    records = root / "records.jsonl"
    records.touch()
    records.chmod(0o666)
    text = SCRIPT.format(python=PY, records=str(records), containers=str(containers), daemon_up=daemon_up)
    for name in names:
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    if toolkit:
        tool = bin_dir / "nvidia-ctk"
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(0o755)
    return StandIn(bin_dir=bin_dir, records_file=records, containers_dir=containers)


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie nobody reaped has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
