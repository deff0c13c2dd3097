"""How the join token reaches the agent without staying where a job (or `ps`) could read it.

`/proc/<pid>/environ` shows the environment a process was *started* with, whatever it deletes
later, and `/proc/<pid>/cmdline` is readable by every user. So the agent takes the token from
- `--join-token-file PATH` (with `--delete-join-token-file`: deleted once the node is registered),
- `--join-token -` (one line on stdin),
- and, for compatibility, `WHALEZEN_JOIN_TOKEN` or a literal `--join-token TOKEN`: then the agent
  re-executes itself (same pid) without them, handing the token over through an inherited pipe
  (`--join-token-fd`, internal), so its live environment and command line no longer hold it.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

JOIN_TOKEN_ENV = "WHALEZEN_JOIN_TOKEN"
FD_OPTION = "--join-token-fd"
MAX_TOKEN_BYTES = 4096  # tokens are ~60 characters; also keeps the hand-over pipe from blocking


class JoinTokenError(ValueError):
    pass


def _literal_token(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the value of a literal `--join-token VALUE`, the arguments without it). `-` is no literal."""
    rest: list[str] = []
    token = None
    items = list(args)
    i = 0
    while i < len(items):
        item = items[i]
        if item == "--join-token" and i + 1 < len(items) and items[i + 1] != "-":
            token, i = items[i + 1], i + 2
            continue
        if item.startswith("--join-token=") and item != "--join-token=-":
            token, i = item.split("=", 1)[1], i + 1
            continue
        rest.append(item)
        i += 1
    return token, rest


def reexec_without_token(args: Sequence[str]) -> None:
    """Re-execute this agent without the join token in its environment or command line.

    Returns only when there is nothing to hide. Call it first thing in a real agent process
    (never in-process from tests: exec replaces the caller).
    """
    literal, rest = _literal_token(args)
    from_env = os.environ.get(JOIN_TOKEN_ENV)
    if literal is None and from_env is None:
        return
    token = literal if literal is not None else from_env
    env = {k: v for k, v in os.environ.items() if k != JOIN_TOKEN_ENV}
    other_source = any(a in ("--join-token", "--join-token-file", FD_OPTION) or a.startswith(("--join-token=",
                       "--join-token-file=", FD_OPTION + "=")) for a in rest)
    if token is not None and not other_source:
        raw = token.encode()
        if len(raw) > MAX_TOKEN_BYTES:
            raise JoinTokenError(f"the join token is longer than {MAX_TOKEN_BYTES} bytes")
        read_end, write_end = os.pipe()
        os.write(write_end, raw)  # fits the pipe's buffer: never blocks
        os.close(write_end)
        os.set_inheritable(read_end, True)
        rest += [FD_OPTION, str(read_end)]
    # sys.orig_argv holds the interpreter and its options (`python -m agent`, or a console script).
    prefix = list(sys.orig_argv[: len(sys.orig_argv) - (len(sys.argv) - 1)])
    prefix[0] = sys.executable
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [*prefix, *rest], env)


def read_join_token(*, value: str | None, path: Path | None, fd: int | None) -> str | None:
    """The token from whichever source was given (at most one); None when none was."""
    given = [s for s in (value, path, fd) if s is not None]
    if len(given) > 1:
        raise JoinTokenError("give the join token one way only: --join-token, --join-token-file or stdin")
    if fd is not None:
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(MAX_TOKEN_BYTES + 1)
    elif path is not None:
        try:
            with open(path, "rb") as handle:
                raw = handle.read(MAX_TOKEN_BYTES + 1)
        except OSError as err:
            raise JoinTokenError(f"--join-token-file {path}: {err.strerror or err}") from None
    elif value == "-":
        raw = sys.stdin.buffer.readline(MAX_TOKEN_BYTES + 1)
    elif value is not None:
        raw = value.encode()
    else:
        return None
    if len(raw) > MAX_TOKEN_BYTES:
        raise JoinTokenError(f"the join token is longer than {MAX_TOKEN_BYTES} bytes")
    token = raw.decode("utf-8", errors="replace").strip()
    if not token:
        raise JoinTokenError("the join token given is empty")
    return token


def delete_token_file(path: Path) -> None:
    """--delete-join-token-file, once the node is registered."""
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        log.warning("cannot delete the join token file %s: %s", path, err)
