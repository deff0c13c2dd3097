"""The first process of every job: it ties the job's lifetime to the agent's.

The agent starts `python -I -S jobshim.py --parent PID --status-fd FD --grace S [--uid U --gid G]
-- ARGV...` in a new session. The shim

1. asks the kernel for SIGTERM when its parent (the agent) dies (PR_SET_PDEATHSIG), then checks
   the agent is still its parent (it may have died before the request took effect);
2. forks the job: the child drops to the job user (no supplementary groups, then gid, then uid)
   and execs ARGV; an exec that fails comes back through a close-on-exec pipe;
3. tells the agent on FD `started PID` or `error ERRNO`, and closes FD;
4. waits for the job and exits as it did (same code, or the same signal), so the agent sees the
   job's own exit status;
5. when the agent dies: SIGTERM to the whole process group (the job and everything it spawned),
   up to `--grace` seconds for the job to end, then SIGKILL to the group, itself included.

It stays the agent's user, so the job can neither signal nor trace it. While the agent lives, a
SIGTERM is the agent stopping the job (sent to the whole group): the shim only waits, and the
agent enforces the grace period. Standard library only, and run with -I -S: it must not import
anything from a directory a job can write, nor pay for site-packages on every job start.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
# os.execvp looks a bare command name up on PATH with os.get_exec_path, which imports `warnings` the
# first time it runs. In the child that is after the drop to the job user, who may not be able to read
# this interpreter's standard library (a Python under a closed home directory such as /root, 0700):
# `python train.py` then failed to start with no reason given. Imported here, as the agent's user, it
# is already loaded when the child needs it.
import warnings  # noqa: F401

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_ORPHANED = 125  # the agent died before the job could be started
EXIT_EXEC_FAILED = 127  # what a shell answers for a command it cannot run


class _AgentGone(Exception):
    pass


def _set_parent_death_signal(sig: int) -> bool:
    """PR_SET_PDEATHSIG (Linux). False where there is no prctl: the shim then polls its parent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parse(argv: list[str]) -> tuple[int, int, float, int | None, int | None, list[str]]:
    # No argparse: this runs on every job start, and its caller is the agent, not a person.
    sep = argv.index("--")
    options = dict(zip(argv[:sep:2], argv[1:sep:2]))
    uid = int(options["--uid"]) if "--uid" in options else None
    gid = int(options["--gid"]) if "--gid" in options else None
    command = argv[sep + 1 :]
    if not command:
        raise ValueError("no command")
    return int(options["--parent"]), int(options["--status-fd"]), float(options["--grace"]), uid, gid, command


def _exec_job(command: list[str], uid: int | None, gid: int | None, errpipe: int) -> None:
    """In the forked child: become the job user and exec. Never returns."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if uid is not None:
            os.setgroups([])
            os.setgid(gid if gid is not None else uid)
            os.setuid(uid)
        os.execvp(command[0], command)
    except OSError as err:
        os.write(errpipe, str(err.errno or 0).encode())
    except BaseException:  # noqa: BLE001 - nothing may escape a forked child
        os.write(errpipe, b"0")
    os._exit(EXIT_EXEC_FAILED)


def _exit_like(status: int) -> None:
    """Exit with the job's own status, so the agent sees its code or signal, not ours."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal that does not kill (SIGCHLD...): say which one it was
    os._exit(os.waitstatus_to_exitcode(status))


def _orphaned(child: int, grace_s: float) -> None:
    """The agent is gone: nobody supervises this job any more. Stop the whole group."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(0, signal.SIGTERM)
    except OSError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            break
        time.sleep(0.05)
    os.killpg(0, signal.SIGKILL)  # grandchildren too; this ends the shim as well


def _wait(child: int, parent: int, *, poll_parent: bool) -> int:
    if not poll_parent:
        return os.waitpid(child, 0)[1]  # PDEATHSIG interrupts this if the agent dies
    while True:  # no PDEATHSIG on this system: look for the agent twice a second
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            return status
        if os.getppid() != parent:
            raise _AgentGone()
        time.sleep(0.5)


def main(argv: list[str]) -> None:
    parent, status_fd, grace_s, uid, gid, command = _parse(argv)
    armed = _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the agent died before PDEATHSIG was armed
        os._exit(EXIT_ORPHANED)

    def on_term(signum: int, frame: object) -> None:
        if os.getppid() != parent:
            raise _AgentGone()
        # Otherwise the agent is stopping the job (the whole group got it): keep waiting.

    # Block SIGTERM across fork so no handler runs between fork and knowing the child's pid.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    signal.signal(signal.SIGTERM, on_term)
    err_r, err_w = os.pipe()  # close-on-exec: EOF without data means exec succeeded
    child = os.fork()
    if child == 0:
        os.close(err_r)
        os.close(status_fd)
        _exec_job(command, uid, gid, err_w)
    os.close(err_w)
    failure = b""
    while chunk := os.read(err_r, 64):
        failure += chunk
    os.close(err_r)
    message = f"error {int(failure or 0)}\n" if failure else f"started {child}\n"
    try:
        os.write(status_fd, message.encode())
        os.close(status_fd)
    except OSError:
        pass  # the agent is gone; PDEATHSIG or the check below handles that
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
        if os.getppid() != parent:
            raise _AgentGone()
        status = _wait(child, parent, poll_parent=not armed)
    except _AgentGone:
        _orphaned(child, grace_s)
        os._exit(EXIT_ORPHANED)
    _exit_like(status)


if __name__ == "__main__":
    main(sys.argv[1:])
