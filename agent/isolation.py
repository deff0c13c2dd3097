"""Who jobs run as, and where their files live, so a job cannot read the agent's secrets.

The agent's state directory holds the node token (identity.json) and the agent key (state.json);
its environment may have held the join token. A job that runs as the agent's user can read all
of that (its files, /proc/<agent>/environ). So jobs run as another, unprivileged user:

- `--job-user USER` (env WHALEZEN_AGENT_JOB_USER) names it; the job gets that user's uid and
  primary gid and no supplementary groups.
- Default for an agent running as root: `whalezen-job` if that user exists (a dedicated user that
  nothing else on the machine uses; the cloud boot script creates it), else `nobody`.
- An unprivileged agent cannot switch users: its jobs share its user. So does `--job-user self`.
  The agent says so at start, in its log and in its registration (`job_isolation: shared-user`).

Job work dirs live outside the 0700 state dir, under a work root (`--work-dir`, default
`<state dir>-jobs`): the root is the agent's, mode 0711 (a job can reach its own dir, not list
the others), and each job's dir is the job user's, mode 0700.
"""
from __future__ import annotations

import logging
import os
import pwd
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

JOB_USER_ENV = "WHALEZEN_AGENT_JOB_USER"
DEDICATED_JOB_USER = "whalezen-job"
FALLBACK_JOB_USER = "nobody"
SELF = "self"  # --job-user self: run jobs as the agent's own user, knowingly
SEPARATE, SHARED = "separate-user", "shared-user"  # the registration's `job_isolation`


class JobUserError(ValueError):
    pass


@dataclass(frozen=True)
class JobUser:
    name: str
    uid: int
    gid: int
    home: str

    @property
    def separate(self) -> bool:
        """True when the job runs as a user other than the agent's (its secrets are out of reach)."""
        return self.uid != os.geteuid()

    @property
    def isolation(self) -> str:
        return SEPARATE if self.separate else SHARED


def _from_passwd(entry: pwd.struct_passwd) -> JobUser:
    return JobUser(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, home=entry.pw_dir)


def agent_user() -> JobUser:
    uid = os.geteuid()
    try:
        return _from_passwd(pwd.getpwuid(uid))
    except KeyError:  # a uid without a passwd entry (containers): still a user
        return JobUser(name=str(uid), uid=uid, gid=os.getegid(), home=os.environ.get("HOME", "/"))


def resolve_job_user(spec: str | None) -> JobUser:
    """The user jobs run as. `spec`: a user name or uid, "self", or None/"" for the default."""
    spec = (spec or "").strip()
    if spec == SELF:
        return agent_user()
    if not spec:
        if os.geteuid() != 0:
            return agent_user()  # cannot switch users; the caller warns
        for name in (DEDICATED_JOB_USER, FALLBACK_JOB_USER):
            try:
                return _from_passwd(pwd.getpwnam(name))
            except KeyError:
                continue
        raise JobUserError(f"neither {DEDICATED_JOB_USER!r} nor {FALLBACK_JOB_USER!r} exists: "
                           "create one or name the job user with --job-user")
    try:
        user = _from_passwd(pwd.getpwuid(int(spec)) if spec.isdigit() else pwd.getpwnam(spec))
    except (KeyError, ValueError, OverflowError):
        raise JobUserError(f"--job-user {spec!r}: no such user") from None
    if user.uid == 0 and os.geteuid() == 0:
        # Running jobs as root is the opposite of what was asked for: say so instead of obeying.
        raise JobUserError("--job-user root would give jobs the agent's secrets; use --job-user self to mean that")
    if user.separate and os.geteuid() != 0:
        raise JobUserError(f"--job-user {user.name}: only an agent running as root can start jobs as another "
                           "user; run the agent as root, or use --job-user self")
    return user


def log_job_isolation(user: JobUser, *, work_dir: Path, state_dir: Path) -> None:
    """Say at start who jobs run as; loudly when they share the agent's user (and its secrets)."""
    if user.separate:
        log.info("jobs run as user %s (uid %d), work dirs under %s", user.name, user.uid, work_dir)
    else:
        log.warning("jobs run as this agent's own user (%s): they can read its state dir %s (node token, "
                    "agent key) and its process environment. Run the agent as root, or with --job-user, to "
                    "run jobs as a separate unprivileged user.", user.name, state_dir)


def default_work_dir(state_dir: Path) -> Path:
    """A sibling of the state dir: `/var/lib/whalezen-agent` -> `/var/lib/whalezen-agent-jobs`."""
    state_dir = Path(state_dir)
    return state_dir.with_name(state_dir.name + "-jobs")


def check_work_dir(work_dir: Path, state_dir: Path) -> None:
    work, state = Path(work_dir).resolve(), Path(state_dir).resolve()
    if work == state or state in work.parents:
        raise JobUserError(f"--work-dir {work_dir} lies inside the state dir {state_dir}: jobs must not be "
                           "able to reach the agent's files")


def prepare_work_root(work_dir: Path, user: JobUser) -> None:
    """Create the work root, the agent's own, 0711 (0700 when jobs share the agent's user anyway).
    Refuses a folder that is someone else's or shared (`--work-dir /tmp` must not chmod /tmp)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    st = os.stat(work_dir)
    if st.st_uid != os.geteuid() or st.st_mode & 0o002:
        raise JobUserError(f"--work-dir {work_dir}: must be a folder of the agent's own, not "
                           f"{'world-writable' if st.st_mode & 0o002 else f'owned by uid {st.st_uid}'}")
    os.chmod(work_dir, 0o711 if user.separate else 0o700)
    if user.separate and not can_reach(work_dir, user, need=os.X_OK):
        log.warning("job user %s cannot reach the work dir %s (a parent directory is closed to it): jobs can "
                    "use relative paths in their work dir only", user.name, work_dir)


def make_job_dir(path: Path, user: JobUser) -> None:
    """The job's own folder: owned by the job user, mode 0700. Raises OSError for anything but a
    real directory in its place (O_NOFOLLOW: a link is refused, never followed)."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if user.separate:
            os.fchown(fd, user.uid, user.gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def job_home(user: JobUser, workdir: Path) -> str:
    """HOME for the job: the job user's home if it exists, else its work dir (`nobody`'s home is
    /nonexistent, which breaks every tool that writes ~/.cache)."""
    return user.home if user.home and os.path.isdir(user.home) else str(workdir)


def can_reach(path: Path, user: JobUser, *, need: int) -> bool:
    """Whether `user` can traverse every parent of `path` and has `need` (os.R_OK/W_OK/X_OK) on it,
    from the permission bits (os.access answers for the agent's uid, not the job user's)."""
    path = Path(os.path.abspath(path))
    for directory in list(reversed(path.parents)):
        if not _allowed(directory, user, os.X_OK):
            return False
    return _allowed(path, user, need)


def _allowed(path: Path, user: JobUser, need: int) -> bool:
    if user.uid == 0:
        return True
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_uid == user.uid:
        shift = 6
    elif st.st_gid == user.gid:
        shift = 3
    else:
        shift = 0
    return (st.st_mode >> shift) & need == need
