"""`whalezen`: the command line on the Python client (`whalezen --help`; README "CLI").

Tables for people; `--json` on every command for scripts (the API's own objects; a failure prints
`{"error": {...}}`). Exit codes (`EXIT_*` below, also in `whalezen --help`):

  0 ok · 1 the API refused or failed (409, 429, 5xx, a feature this server lacks) · 2 usage or bad spec
  (a bad file, the API's 400 with its fields) · 3 auth (no login, wrong/expired/revoked token, not
  allowed) · 4 server unreachable or timed out · 5 not found (also another team's object) · 6 the job
  ended FAILED or CANCELLED while waited for · 7 gave up waiting (`--timeout`) · 130 interrupted.
"""
from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from whalezen import __version__, config, errors, specfile, uploads
from whalezen.client import DEFAULT_TIMEOUT_S, Client, normalise_url
from whalezen.types import RUNNING_STATES, TERMINAL_STATES, Job, JobEvent

EXIT_OK = 0
EXIT_API = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_UNREACHABLE = 4
EXIT_NOT_FOUND = 5
EXIT_JOB_FAILED = 6
EXIT_TIMEOUT = 7
EXIT_INTERRUPTED = 130

EXIT_CODES_HELP = """exit codes:
  0  ok
  1  the API refused or failed (409 conflict, 429, 5xx, a route this server does not have)
  2  usage error or bad spec (unreadable file, bad YAML/JSON, the API's 400 with its fields)
  3  auth: not logged in, wrong/expired/revoked token, or not allowed (403)
  4  server unreachable or no answer in time
  5  not found (another team's objects are not found either)
  6  the job ended FAILED or CANCELLED while waiting for it (submit --wait)
  7  gave up waiting (--timeout)
environment: WHALEZEN_URL and WHALEZEN_TOKEN override the stored login (whalezen login);
  XDG_CONFIG_HOME moves the login file (default ~/.config/whalezen/config.json)."""

COLUMN_MAX = 48
SPINNER = "|/-\\"


class CliError(Exception):
    def __init__(self, message: str, code: int, *, fields: Mapping[str, list[str]] | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.fields, self.status = message, code, fields, status


class Out:
    """Where a command writes: data to stdout, progress and errors to stderr."""

    def __init__(self, stdout: IO[str], stderr: IO[str], *, json_mode: bool) -> None:
        self.stdout, self.stderr, self.json_mode = stdout, stderr, json_mode
        self.progress_live = False

    def line(self, text: str = "") -> None:
        self.clear_progress()  # stdout and stderr are often the same terminal
        self.stdout.write(text + "\n")
        self.stdout.flush()

    def json(self, value: Any, *, compact: bool = False) -> None:
        self.stdout.write(json.dumps(value, indent=None if compact else 2, ensure_ascii=False) + "\n")
        self.stdout.flush()

    def note(self, text: str) -> None:
        self.clear_progress()
        self.stderr.write(text + "\n")
        self.stderr.flush()

    def progress(self, text: str) -> None:
        """A line redrawn in place on a terminal; on anything else each change is a line of its own."""
        if _isatty(self.stderr):
            self.stderr.write("\r\x1b[K" + text[: _width() - 1])
            self.progress_live = True
        else:
            self.stderr.write(text + "\n")
        self.stderr.flush()

    def clear_progress(self) -> None:
        if self.progress_live:
            self.stderr.write("\r\x1b[K")
            self.stderr.flush()
            self.progress_live = False


# -- helpers ---------------------------------------------------------------------------------------
def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 100


def positive_id(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"an id is a positive whole number, not {text!r}")
    return int(text)


def _when(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def ago(value: str | None, now: datetime | None = None) -> str:
    moment = _when(value)
    if moment is None:
        return "-"
    seconds = max(0, int(((now or datetime.now(timezone.utc)) - moment).total_seconds()))
    return duration(seconds) + " ago"


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s" if seconds < 600 else f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
    return f"{seconds // 86400}d{(seconds % 86400) // 3600}h"


def clock(value: str | None) -> str:
    moment = _when(value)
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S") if moment else "-"


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return " ".join(str(value).split())  # no newlines or tabs inside a cell


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Columns padded to their widest cell (at most COLUMN_MAX; longer cells end with `…`)."""
    text_rows = [[cell(v) for v in row] for row in rows]
    text_rows = [[v if len(v) <= COLUMN_MAX else v[: COLUMN_MAX - 1] + "…" for v in row] for row in text_rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        widths = [max(w, len(v)) for w, v in zip(widths, row)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in text_rows]
    return "\n".join(lines)


def gpus_of(job: Job) -> str:
    demand = job.get("demand") or {}
    if demand.get("compute_units"):
        return f"{demand['compute_units']:g} CU"
    models = "/".join(demand.get("gpu_models") or []) or "any"
    milli = demand.get("gpu_milli") or 1000
    if milli < 1000:
        return f"{milli / 1000:g}x{models}"
    nodes, per_node = demand.get("nodes") or 1, demand.get("gpus_per_node") or 0
    count = f"{nodes}x{per_node}" if nodes > 1 else str(per_node)
    return f"{count}x{models}"


def where_of(job: Job) -> str:
    allocations = job.get("allocations") or []
    if allocations:
        return ", ".join(f"{a['node']}[{','.join(str(g) for g in a['gpus'])}]" for a in allocations)
    reason = job.get("pending_reason")
    if reason:
        return f"waits: {reason.get('code') or '?'}"
    return "-"


def _reason_line(reason: Mapping[str, Any] | None) -> str:
    if not reason:
        return ""
    code, message = reason.get("code") or "?", (reason.get("message") or "").strip()
    if message.startswith(code):
        return message  # the engine's messages often lead with their code already
    return f"{code}: {message}" if message else code


def _columns(rows: Sequence[Mapping[str, Any]], first: Sequence[str] = ()) -> list[str]:
    keys: list[str] = [k for k in first if any(k in row for row in rows)]
    for row in rows:
        for key in row:
            if key not in keys:
                keys.append(key)
    return keys


# -- commands --------------------------------------------------------------------------------------
class Context:
    def __init__(self, args: argparse.Namespace, env: Mapping[str, str], out: Out) -> None:
        self.args, self.env, self.out = args, env, out
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        if self._client is None:
            login = config.resolve_login(self.env, url=getattr(self.args, "url", None))
            if not login.token:
                raise config.NotLoggedIn(f"no token for {login.url}: run `whalezen login {login.url}` "
                                         "or set WHALEZEN_TOKEN")
            if login.source != "environment" and config.too_open(self.env):
                self.out.note(f"whalezen: warning: {login.source} is readable by other users: "
                              f"chmod 600 {login.source} (or log in again)")
            self._client = make_client(self.args, login.url, login.token)
        return self._client


def make_client(args: argparse.Namespace, url: str, token: str | None) -> Client:
    try:
        return Client(url, token, timeout_s=getattr(args, "request_timeout", DEFAULT_TIMEOUT_S),
                      user_agent=f"whalezen-cli/{__version__}")
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def cmd_login(ctx: Context) -> int:
    args, env, out = ctx.args, ctx.env, ctx.out
    url = args.server or getattr(args, "url", None) or env.get("WHALEZEN_URL") or config.load(env).get("url")
    if not url:
        raise CliError("which server? `whalezen login http://host:8000`", EXIT_USAGE)
    try:
        url = normalise_url(url)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    token = args.token
    if args.token_stdin or (token is None and not _isatty(sys.stdin)):
        token = sys.stdin.readline().strip()
    elif token is None:
        token = getpass.getpass(f"API token for {url}: ").strip()
    if not token:
        raise CliError("no token given (a token is printed by `make run`, or made with `whalezen tokens create`)",
                       EXIT_USAGE)
    client = make_client(args, url, token)
    try:
        quota = client.quota()
    except errors.AuthError as exc:
        raise CliError(f"the server refused this token ({exc.detail}); nothing was stored", EXIT_AUTH) from None
    user = None
    try:
        prefix = token.split("_")[1] if token.count("_") >= 2 else None  # wz_<prefix>_<secret>
        user = next((t["user"] for t in client.tokens() if prefix and t["prefix"] == prefix), None)
    except errors.ApiError:
        pass
    path = config.save(url, token, env)
    team = quota.get("tenant")
    if out.json_mode:
        out.json({"url": url, "team": team, "user": user, "config": str(path)})
    else:
        who = f" as {user}" if user else ""
        out.line(f"Logged in to {url}{who} (team {team}). Stored in {path} (mode 0600).")
    return EXIT_OK


def cmd_logout(ctx: Context) -> int:
    removed = config.forget(ctx.env)
    if ctx.out.json_mode:
        ctx.out.json({"logged_out": removed, "config": str(config.config_path(ctx.env))})
    else:
        ctx.out.line("Logged out." if removed else "Not logged in.")
    return EXIT_OK


def _read_spec(path: str) -> dict[str, Any]:
    try:
        return specfile.read(path)
    except errors.SpecError as exc:
        raise CliError(f"bad spec {_file(path)}: {exc}", EXIT_USAGE) from None


def _file(path: str) -> str:
    return "on stdin" if path == "-" else path


def _spec_refused(path: str, exc: errors.BadRequest) -> CliError:
    return CliError(f"bad spec {_file(path)}: {exc.detail}", EXIT_USAGE, fields=exc.fields, status=exc.status)


def _with_env(spec: dict[str, Any], pairs: list[str], *, secret: bool) -> dict[str, Any]:
    """`--env NAME=VALUE` (and `--secret`) into the spec: a SkyPilot task's `envs` / `secrets` (filling
    the values it leaves to submit time), a native spec's `env` / `secrets`."""
    if not pairs:
        return spec
    values: dict[str, str] = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals or not name:
            raise CliError(f"--{'secret' if secret else 'env'} {pair!r}: give NAME=VALUE", EXIT_USAGE)
        values[name] = value
    skypilot = any(key in spec for key in ("run", "setup", "envs", "secrets", "num_nodes"))
    key = "secrets" if secret else ("envs" if skypilot else "env")
    if "apiVersion" in spec:
        raise CliError("--env and --secret do not apply to a Kubernetes manifest: set env in its container",
                       EXIT_USAGE)
    merged = dict(spec.get(key) or {})
    merged.update(values)
    return {**spec, key: merged}


def _show_remarks(out: Out, body: dict[str, Any]) -> None:
    for remark in body.get("warnings") or []:
        out.note(f"warning: {remark['field']}: {remark['message']}")


def _pack_local(ctx: Context, spec: dict[str, Any]) -> list[uploads.Packed]:
    """A SkyPilot task's local workdir and file_mounts sources, packed (whalezen/uploads.py); exit 2 when
    one is missing or over the limits."""
    if ctx.args.format == "kubernetes":
        return []
    packed: list[uploads.Packed] = []
    try:
        for source in uploads.local_sources(spec, cwd=Path.cwd()):
            packed.append(uploads.pack(source, max_bytes=uploads.max_upload_bytes(ctx.env)))
    except (uploads.PackError, OSError) as exc:
        for done in packed:
            done.discard()
        reason = exc if isinstance(exc, uploads.PackError) else f"{exc.filename}: {exc.strerror or exc}"
        raise CliError(f"cannot upload {reason}", EXIT_USAGE) from None
    return packed


def _upload_all(ctx: Context, spec: dict[str, Any], packed: list[uploads.Packed]) -> dict[str, Any]:
    ids: dict[str, str] = {}
    for item in packed:
        for skipped in item.skipped:
            ctx.out.note(f"note: {item.source.field}: left out {skipped}")
        try:
            answer = ctx.client.upload(item.archive, kind=item.kind, sha256=item.sha256)
        except errors.BadRequest as exc:
            raise CliError(f"upload of {item.source.field} {item.source.given} refused: {exc.detail}", EXIT_USAGE,
                           fields=exc.fields, status=exc.status) from None
        ids[item.source.field] = answer["id"]
        if not ctx.out.json_mode:
            ctx.out.note(f"uploaded {uploads.describe(item)} as upload:{answer['id']}")
    return uploads.with_uploads(spec, ids)


def cmd_submit(ctx: Context) -> int:
    args = ctx.args
    spec = _with_env(_with_env(_read_spec(args.file), args.env, secret=False), args.secret, secret=True)
    packed = _pack_local(ctx, spec)
    try:
        if args.dry_run:
            return _dry_run(ctx, spec, packed)
        if packed:
            spec = _upload_all(ctx, spec, packed)
        return _cmd_submit(ctx, spec)
    finally:
        for item in packed:
            item.discard()


def _dry_run(ctx: Context, spec: dict[str, Any], packed: list[uploads.Packed]) -> int:
    args, out = ctx.args, ctx.out
    try:
        result = ctx.client.submit_dry_run(spec, format=args.format)
    except errors.BadRequest as exc:
        raise _spec_refused(args.file, exc) from None
    # What a real submission uploads is no problem: the server only sees a local path it cannot read.
    uploaded = {item.source.field for item in packed}
    result["problems"] = [p for p in result.get("problems") or [] if p.get("field") not in uploaded]
    result["uploads"] = [{"field": item.source.field, "path": str(item.source.path), "kind": item.kind,
                          "files": item.files, "unpacked_bytes": item.unpacked_bytes, "size_bytes": item.size_bytes}
                         for item in packed]
    if out.json_mode:
        out.json(result)
    else:
        out.line(json.dumps({"format": result["format"], "demand": result["demand"], "spec": result["spec"]},
                            indent=2))
        for item in packed:
            out.note(f"would upload {uploads.describe(item)} (nothing sent in a dry run)")
        _show_remarks(out, result)
        for problem in result["problems"]:
            out.note(f"problem: {problem['field']}: {problem['message']}")
    return EXIT_USAGE if result["problems"] else EXIT_OK


def _cmd_submit(ctx: Context, spec: dict[str, Any]) -> int:
    args, out = ctx.args, ctx.out
    try:
        job = ctx.client.submit(spec, format=args.format)
    except errors.BadRequest as exc:
        raise _spec_refused(args.file, exc) from None
    except errors.Unreachable as exc:
        if exc.timed_out:
            raise CliError(f"{exc.message}; the job may have been submitted: check `whalezen ls` before "
                           "submitting again", EXIT_UNREACHABLE) from None
        raise
    if not out.json_mode:
        _show_remarks(out, job)
    if not args.wait:
        if out.json_mode:
            out.json(job)
        else:
            out.line(str(job["id"]))
            out.note(f"submitted job {job['id']} ({job['name']}): {job['state']}")
        return EXIT_OK
    if not out.json_mode:
        out.line(str(job["id"]))
    return wait_for_job(ctx, job)


def wait_for_job(ctx: Context, job: Job) -> int:
    """Poll until the job runs or ends; a progress line while it waits."""
    args, out = ctx.args, ctx.out
    started = time.monotonic()
    tick = 0
    last_shown = None
    while True:
        state = job["state"]
        if state in RUNNING_STATES or state in TERMINAL_STATES:
            out.clear_progress()
            if out.json_mode:
                out.json(job)
            else:
                where = where_of(job)
                out.note(f"job {job['id']} {state}" + (f" on {where}" if job.get("allocations") else ""))
            return EXIT_JOB_FAILED if state in ("FAILED", "CANCELLED") else EXIT_OK
        elapsed = time.monotonic() - started
        if args.timeout is not None and elapsed >= args.timeout:
            out.clear_progress()
            raise CliError(f"job {job['id']} is still {state} after {duration(elapsed)}; gave up waiting "
                           f"(it keeps its place: `whalezen events {job['id']} --follow`)", EXIT_TIMEOUT)
        reason = _reason_line(job.get("pending_reason"))
        shown = (state, reason)
        if _isatty(out.stderr):
            out.progress(f"{SPINNER[tick % 4]} job {job['id']} {state} {duration(elapsed)}"
                         + (f"  {reason}" if reason else ""))
        elif shown != last_shown:
            out.progress(f"job {job['id']} {state}" + (f": {reason}" if reason else ""))
        last_shown = shown
        tick += 1
        time.sleep(args.interval)
        job = ctx.client.job(job["id"])


def cmd_ls(ctx: Context) -> int:
    args, out = ctx.args, ctx.out
    states = [s.strip().upper() for value in args.state or [] for s in value.split(",") if s.strip()]
    filters = {"state": states or None, "name": args.name}
    if args.all:
        jobs = list(ctx.client.iter_jobs(**filters))
    else:
        jobs = ctx.client.jobs(**filters, page_size=args.limit)["results"]
    if out.json_mode:
        out.json(jobs)
        return EXIT_OK
    if not jobs:
        out.note("no jobs" + (" matching" if states or args.name else ""))
        return EXIT_OK
    out.line(table(["ID", "NAME", "STATE", "PRIO", "GPUS", "OWNER", "AGE", "WHERE / WHY"],
                   [[j["id"], j["name"], j["state"], j["priority"], gpus_of(j), j["owner"], ago(j["created_at"]),
                     where_of(j)] for j in jobs]))
    return EXIT_OK


def cmd_show(ctx: Context) -> int:
    job = ctx.client.job(ctx.args.id)
    out = ctx.out
    if out.json_mode:
        out.json(job)
        return EXIT_OK
    spec = job.get("spec") or {}
    rows = [
        ("job", f"{job['id']} {job['name']}"),
        ("state", job["state"]),
        ("owner", job["owner"]),
        ("priority", f"{job['priority']}" + (", preemptible" if job.get("preemptible") else "")),
        ("gpus", gpus_of(job)),
        ("command", " ".join(spec.get("command") or []) or None),
        ("image", spec.get("image")),
        ("created", f"{clock(job['created_at'])} ({ago(job['created_at'])})"),
        ("started", clock(job.get("started_at")) if job.get("started_at") else None),
        ("finished", clock(job.get("finished_at")) if job.get("finished_at") else None),
    ]
    for allocation in job.get("allocations") or []:
        rows.append(("runs on", f"{allocation['node']} GPUs {','.join(str(g) for g in allocation['gpus'])}"))
    if job.get("pending_reason"):
        rows.append(("waits", _reason_line(job["pending_reason"])))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        if value is not None:
            out.line(f"{key.ljust(width)}  {value}")
    return EXIT_OK


def _event_row(event: JobEvent) -> list[Any]:
    return [clock(event["created_at"]), event["kind"], event.get("reason_code") or "", event.get("message") or ""]


def cmd_events(ctx: Context) -> int:
    args, out, client = ctx.args, ctx.out, ctx.client
    events = list(client.iter_events(args.id))
    if not args.follow:
        if out.json_mode:
            out.json(events)
        elif events:
            out.line(table(["TIME", "KIND", "CODE", "MESSAGE"], [_event_row(e) for e in events]))
        else:
            out.note(f"job {args.id} has no events yet")
        return EXIT_OK
    started = time.monotonic()

    def show(batch: list[JobEvent]) -> None:
        for event in batch:
            if out.json_mode:
                out.json(event, compact=True)  # JSON Lines while following
            else:
                when, kind, code, message = (cell(v) for v in _event_row(event))
                out.line(f"{when}  {kind:<9} {code or '-':<18} {message}".rstrip())

    show(events)
    seen, polls = len(events), 0
    while True:
        job = client.job(args.id)
        batch = list(client.iter_events(args.id, skip=seen))  # after the state: nothing of the end is missed
        show(batch)
        seen += len(batch)
        if job["state"] in TERMINAL_STATES:
            if not out.json_mode:
                out.note(f"job {args.id} ended: {job['state']}")
            return EXIT_OK
        if args.timeout is not None and time.monotonic() - started >= args.timeout:
            out.clear_progress()
            raise CliError(f"job {args.id} is still {job['state']}; stopped following after "
                           f"{duration(time.monotonic() - started)}", EXIT_TIMEOUT)
        if not out.json_mode and _isatty(out.stderr):  # a live status line between events, on a terminal only
            out.progress(f"{SPINNER[polls % 4]} job {args.id} {job['state']}, following for "
                         f"{duration(time.monotonic() - started)} (Ctrl-C stops)")
        polls += 1
        time.sleep(args.interval)


def cmd_explain(ctx: Context) -> int:
    job = ctx.client.job(ctx.args.id)
    out, reason = ctx.out, job.get("pending_reason")
    if out.json_mode:
        out.json({"id": job["id"], "state": job["state"], "pending_reason": reason})
        return EXIT_OK
    if not reason:
        where = where_of(job)
        out.line(f"job {job['id']} is {job['state']}: not waiting" + (f" (on {where})" if where != "-" else ""))
        return EXIT_OK
    out.line(f"job {job['id']} waits: {reason.get('code') or '?'}")
    if reason.get("message"):
        out.line(f"  {reason['message']}")
    data = reason.get("data") or {}
    if isinstance(data, dict):
        for key, value in data.items():
            out.line(f"  {key}: {cell(value)}")
    return EXIT_OK


def cmd_cancel(ctx: Context) -> int:
    job = ctx.client.cancel(ctx.args.id)
    if ctx.out.json_mode:
        ctx.out.json(job)
    else:
        ctx.out.line(f"job {job['id']} {job['state']}")
    return EXIT_OK


def cmd_checkpoint(ctx: Context) -> int:
    job = ctx.client.checkpoint(ctx.args.id)
    if ctx.out.json_mode:
        ctx.out.json(job)
    else:
        ctx.out.line(f"job {job['id']} {job['state']}: checkpoint requested "
                     f"(`whalezen events {job['id']} --follow` shows when it is committed)")
    return EXIT_OK


def cmd_migrate(ctx: Context) -> int:
    move = ctx.client.migrate(ctx.args.id, pool=ctx.args.pool, node=ctx.args.node)
    if ctx.out.json_mode:
        ctx.out.json(move)
    else:
        ctx.out.line(f"job {ctx.args.id}: move {move.get('id')} {move.get('state')} from {move.get('source') or '-'} "
                     f"to {move.get('target') or 'anywhere'} (`whalezen events {ctx.args.id} --follow`)")
    return EXIT_OK


def _rows_table(rows: Sequence[Mapping[str, Any]], first: Sequence[str]) -> str:
    """A table of API rows: the `first` columns in that order, then any others; nested values left out."""
    keys = [k for k in _columns(rows, first) if not any(isinstance(r.get(k), (dict, list)) for r in rows)]
    return table([k.upper() for k in keys], [[_value(k, r.get(k)) for k in keys] for r in rows])


def _value(key: str, value: Any) -> Any:
    """Times (`*_at`, start, end) in local time, like the other tables."""
    if isinstance(value, str) and (key.endswith("_at") or key in ("start", "end")) and _when(value):
        return clock(value)
    return value


def cmd_quote(ctx: Context) -> int:
    args, out = ctx.args, ctx.out
    spec = _read_spec(args.file)
    try:
        quote = ctx.client.quote(spec)
    except errors.BadRequest as exc:
        raise _spec_refused(args.file, exc) from None
    if out.json_mode:
        out.json(quote)
        return EXIT_OK
    options = quote.get("options") or []
    if not options:
        reasons = quote.get("unplaceable") or []
        why = "; ".join(f"{r.get('code')}: {r.get('message')}" for r in reasons if isinstance(r, dict))
        out.line("no feasible option now" + (f": {why}" if why else ""))
        return EXIT_OK
    out.line(_rows_table(options, ["where", "gpu_model", "gpus", "market", "price_per_hour_usd", "expected_hours",
                                   "expected_cost_usd", "starts_at"]))
    return EXIT_OK


def _group_keys(args: argparse.Namespace) -> list[str]:
    return [g.strip() for value in args.group_by or [] for g in value.split(",") if g.strip()]


def cmd_costs(ctx: Context) -> int:
    args, out = ctx.args, ctx.out
    group_by = _group_keys(args)
    if args.csv:
        text = ctx.client.costs_csv(group_by=group_by or None, from_=args.from_, to=args.to, team=args.team)
        out.stdout.write(text if text.endswith("\n") or not text else text + "\n")
        return EXIT_OK
    report = ctx.client.costs(group_by=group_by or None, from_=args.from_, to=args.to, team=args.team)
    if out.json_mode:
        out.json(report)
        return EXIT_OK
    rows = report.get("rows") or report.get("results") or []
    if report.get("from") or report.get("to"):
        out.note(f"costs from {report.get('from')} to {report.get('to')} (exclusive)"
                 + (f", {report['scope']}" if report.get("scope") else "")
                 + (f", in {report['currency']}" if report.get("currency") else ""))
    if not rows:
        out.note("no costs in this period")
    else:
        out.line(_rows_table(rows, [*group_by, "gpu_hours", "cost", "idle_cost", "avg_gpu_utilisation"]))
    total = report.get("total") or report.get("totals")
    if isinstance(total, dict) and total:
        out.line("total: " + ", ".join(f"{k} {cell(v)}" for k, v in total.items()))
    return EXIT_OK


def cmd_savings(ctx: Context) -> int:
    args, out = ctx.args, ctx.out
    report = ctx.client.savings(from_=args.from_, to=args.to)
    if out.json_mode:
        out.json(report)
        return EXIT_OK
    jobs = report.get("jobs") or []
    if report.get("from") or report.get("to"):
        out.note(f"savings from {report.get('from')} to {report.get('to')} (exclusive), against the cheapest "
                 "single-cloud on-demand offer of each job's GPU model")
    if jobs:
        out.line(_rows_table(jobs, ["job", "job_name", "gpu_hours", "cost_usd", "on_demand_usd", "saved_usd",
                                    "cheapest_offer"]))
    else:
        out.note("no jobs in this period")
    totals = report.get("totals")
    if isinstance(totals, dict) and totals:
        out.line("totals: " + ", ".join(f"{k} {cell(v)}" for k, v in totals.items()))
    return EXIT_OK


def cmd_statements(ctx: Context) -> int:
    args, out = ctx.args, ctx.out
    if args.month:
        statement = ctx.client.statement(args.month, csv=args.csv, team=args.team)
        if isinstance(statement, str):
            out.stdout.write(statement if statement.endswith("\n") else statement + "\n")
        elif out.json_mode:
            out.json(statement)
        else:
            out.line(f"statement {statement.get('month', args.month)} for team {statement.get('team', '?')}: "
                     f"{statement.get('status', '')}".rstrip(": "))
            lines = statement.get("lines") or []
            if lines:
                out.line(_rows_table(lines, ["job", "job_name", "user", "gpu_model", "provider", "pool", "region",
                                             "gpu_hours", "rate_usd_per_gpu_hour", "amount_usd"]))
            totals = statement.get("totals") or statement.get("total")
            if isinstance(totals, dict):
                out.line("totals: " + ", ".join(f"{k} {cell(v)}" for k, v in totals.items()))
        return EXIT_OK
    statements = ctx.client.statements(team=args.team)
    if out.json_mode:
        out.json(statements)
    elif statements:
        out.line(_rows_table(statements, ["month", "team", "status", "total_usd"]))
    else:
        out.note("no statements")
    return EXIT_OK


def cmd_budget(ctx: Context) -> int:
    args, out = ctx.args, ctx.out
    if args.set is not None:
        value = None if args.set.lower() in ("none", "off", "") else args.set
        budget = ctx.client.set_budget(value)
    else:
        budget = ctx.client.budget()
    if out.json_mode:
        out.json(budget)
        return EXIT_OK
    pairs = [(k, v) for k, v in budget.items() if not isinstance(v, (dict, list))]
    pairs += [("alert", alert) for alert in budget.get("alerts") or []]
    width = max((len(k) for k, _ in pairs), default=0)
    for key, value in pairs:
        out.line(f"{key.ljust(width)}  {cell(value)}")
    return EXIT_OK


def cmd_nodes(ctx: Context) -> int:
    nodes = ctx.client.nodes(state=ctx.args.state)
    out = ctx.out
    if out.json_mode:
        out.json(nodes)
        return EXIT_OK
    if not nodes:
        out.note("no nodes")
        return EXIT_OK
    rows = []
    for node in nodes:
        gpus = node.get("gpus") or []
        models: dict[str, int] = {}
        for gpu in gpus:
            models[gpu["model"]] = models.get(gpu["model"], 0) + 1
        # A GPU held outside WhaleZen (another pod's request on a Kubernetes node) is taken, not free.
        free = sum(1 for g in gpus
                   if not g.get("in_use") and not g.get("held_outside") and g.get("health") == "HEALTHY")
        utils = [g["utilization_pct"] for g in gpus if g.get("utilization_pct") is not None]
        mine = sorted({h["job"] for g in gpus for h in g.get("held_by") or [] if h.get("job")})
        pool = node["pool"] + (" (shared)" if node.get("shared") else "")
        rows.append([node["name"], pool, node["state"], ", ".join(f"{n}x{m}" for m, n in models.items()) or "-",
                     f"{free}/{len(gpus)}", f"{sum(utils) / len(utils):.0f}%" if utils else "-",
                     ",".join(str(j) for j in mine) or "-", ago(node.get("last_heartbeat_at"))])
    out.line(table(["NAME", "POOL", "STATE", "GPUS", "FREE", "UTIL", "YOUR JOBS", "HEARTBEAT"], rows))
    return EXIT_OK


def cmd_pools(ctx: Context) -> int:
    pools = ctx.client.pools()
    if ctx.out.json_mode:
        ctx.out.json(pools)
        return EXIT_OK
    ctx.out.line(table(["ID", "NAME", "KIND", "REGION", "NODES", "OWNER", "SHARED", "RATE $/GPU-H"],
                       [[p["id"], p["name"], p["kind"], p.get("region") or "-", p.get("node_count"), p.get("owner"),
                         p.get("shared"), p.get("gpu_hour_rate_usd")] for p in pools]))
    return EXIT_OK


def cmd_quota(ctx: Context) -> int:
    quota = ctx.client.quota()
    out = ctx.out
    if out.json_mode:
        out.json(quota)
        return EXIT_OK
    pairs = [(key, quota[key]) for key in ("tenant", "max_gpus", "max_compute_units", "monthly_budget_usd",
                                           "max_pending_jobs", "fair_share_factor") if key in quota]
    pairs += [(f"usage.{key}", value) for key, value in (quota.get("usage") or {}).items()]
    width = max((len(k) for k, _ in pairs), default=0)
    for key, value in pairs:
        out.line(f"{key.ljust(width)}  {cell(value)}")
    shares = quota.get("quotas") or []
    if shares:
        keys = _columns(shares, ["flavor", "nominal", "in_use", "borrowed", "borrowing_limit", "lending_limit"])
        out.line(table([k.upper() for k in keys], [[q.get(k) for k in keys] for q in shares]))
    return EXIT_OK


def cmd_tokens(ctx: Context) -> int:
    args, out, client = ctx.args, ctx.out, ctx.client
    if args.action == "create":
        if not args.name:
            raise CliError("`whalezen tokens create NAME`", EXIT_USAGE)
        scopes = [s for value in args.scope or [] for s in value.split(",") if s]
        created = client.create_token(args.name, scopes=scopes or None, expires_in_days=args.expires_in_days)
        if out.json_mode:
            out.json(created)
        else:
            out.line(created["token"])
            out.note(f"token {created['id']} ({created['prefix']}, scopes {','.join(created['scopes'])}): "
                     "the secret above is shown only once")
        return EXIT_OK
    if args.action == "revoke":
        if not args.name or not args.name.isdigit():
            raise CliError("`whalezen tokens revoke ID`", EXIT_USAGE)
        token = client.revoke_token(int(args.name))
        if out.json_mode:
            out.json(token)
        else:
            out.line(f"token {token['id']} ({token['prefix']}) revoked")
        return EXIT_OK
    tokens = client.tokens()
    if out.json_mode:
        out.json(tokens)
        return EXIT_OK
    out.line(table(["ID", "NAME", "PREFIX", "USER", "SCOPES", "ACTIVE", "EXPIRES", "LAST USED"],
                   [[t["id"], t["name"], t["prefix"], t["user"], ",".join(t["scopes"]), t["active"],
                     clock(t.get("expires_at")) if t.get("expires_at") else "never", ago(t.get("last_used_at"))]
                    for t in tokens]))
    return EXIT_OK


def cmd_logs(ctx: Context) -> int:
    text = ctx.client.logs(ctx.args.id)
    out = ctx.out
    if out.json_mode:
        out.json({"id": ctx.args.id, "output": text})
        return EXIT_OK
    if not text:
        out.note(f"no output of job {ctx.args.id} yet (its node's agent sends the end of the output when a "
                 "run ends)")
        return EXIT_OK
    out.stdout.write(text if text.endswith("\n") else text + "\n")
    return EXIT_OK


# -- the parser ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    def options(p: argparse.ArgumentParser) -> None:
        # Before or after the command (`whalezen --json ls`, `whalezen ls --json`): SUPPRESS keeps the
        # command's parser from overwriting what was given before it.
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                       help="JSON for scripts (the API's objects)")
        p.add_argument("--url", default=argparse.SUPPRESS,
                       help="the server (default: WHALEZEN_URL, then the stored login)")
        p.add_argument("--request-timeout", type=float, default=argparse.SUPPRESS, metavar="S",
                       help=f"seconds to wait for each answer (default {DEFAULT_TIMEOUT_S:g})")

    common = argparse.ArgumentParser(add_help=False)
    options(common)
    parser = argparse.ArgumentParser(
        prog="whalezen", description="WhaleZen from the command line: submit, watch, explain, move and cost "
                                     "GPU jobs.",
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"whalezen {__version__}")
    options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, func: Callable[[Context], int], help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text, epilog=EXIT_CODES_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    def waiting(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--timeout", type=float, default=None, metavar="S",
                       help=f"give up {what} after S seconds (exit 7)")
        p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between polls (default 1)")

    p = add("login", cmd_login, "store a server and token (verified first) for the other commands")
    p.add_argument("server", nargs="?", help="e.g. http://127.0.0.1:8000")
    p.add_argument("--token", help="the token (visible to other users in `ps`: prefer the prompt or --token-stdin)")
    p.add_argument("--token-stdin", action="store_true", help="read the token from standard input")
    add("logout", cmd_logout, "forget the stored login")

    p = add("submit", cmd_submit, "submit a job spec (YAML or JSON; `-` reads stdin): ours, a SkyPilot task "
                                  "file or a Kubernetes Pod/Job manifest; print its id")
    p.add_argument("file")
    p.add_argument("--wait", action="store_true", help="then show progress until it runs or ends")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and normalise only (nothing is created); exit 2 if something would block it")
    p.add_argument("--format", choices=["whalezen", "skypilot", "kubernetes"],
                   help="how the file is written (default: told by its shape)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set an environment variable (fills a SkyPilot task's `envs` left null; repeatable)")
    p.add_argument("--secret", action="append", default=[], metavar="NAME=VALUE",
                   help="a secret variable (kept out of the stored spec, events and logs; repeatable)")
    waiting(p, "waiting")

    p = add("ls", cmd_ls, "list the team's jobs, newest first")
    p.add_argument("--state", action="append", metavar="STATE", help="only these states (repeat, or comma-separated)")
    p.add_argument("--name", help="names containing this")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50, max 500)")
    p.add_argument("--all", action="store_true", help="every matching job")

    for name, func, text in [("show", cmd_show, "one job: state, where it runs, why it waits"),
                             ("explain", cmd_explain, "why a job waits: the engine's reason and its numbers"),
                             ("cancel", cmd_cancel, "cancel a job"),
                             ("checkpoint", cmd_checkpoint, "ask a running job for a checkpoint now"),
                             ("logs", cmd_logs, "the end of a job's output")]:
        add(name, func, text).add_argument("id", type=positive_id)

    p = add("events", cmd_events, "a job's event log")
    p.add_argument("id", type=positive_id)
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events until the job ends")
    waiting(p, "following")

    p = add("migrate", cmd_migrate, "move a running job by checkpoint: into a pool, to a node, or anywhere else")
    p.add_argument("id", type=positive_id)
    p.add_argument("--pool", help="a pool's name")
    p.add_argument("--node", help="a node's name")

    p = add("quote", cmd_quote, "what a spec would cost and where it could run (nothing is submitted)")
    p.add_argument("file")

    p = add("costs", cmd_costs, "the team's costs, grouped")
    p.add_argument("--group-by", action="append", metavar="KEYS",
                   help="team, user, job, gpu_model, provider, pool, region, day (comma-separated or repeated)")
    p.add_argument("--from", dest="from_", metavar="DATE", help="start (ISO date or time)")
    p.add_argument("--to", metavar="DATE", help="end (ISO date or time)")
    p.add_argument("--csv", action="store_true", help="the server's CSV")
    p.add_argument("--team", metavar="SLUG", help="platform admins: another team, or `all`")

    p = add("savings", cmd_savings, "what the team's jobs cost against the cheapest on-demand cloud offer")
    p.add_argument("--from", dest="from_", metavar="DATE", help="start (ISO date)")
    p.add_argument("--to", metavar="DATE", help="end (ISO date, exclusive)")

    p = add("statements", cmd_statements, "monthly statements (one month with MONTH)")
    p.add_argument("month", nargs="?", help="YYYY-MM")
    p.add_argument("--csv", action="store_true")
    p.add_argument("--team", metavar="SLUG", help="platform admins: another team's statements")

    p = add("budget", cmd_budget, "this month's budget and spend; --set USD changes it (team admins)")
    p.add_argument("--set", metavar="USD", help="the new monthly budget (`none`: no budget)")

    p = add("nodes", cmd_nodes, "nodes the team may use, with their GPUs")
    p.add_argument("--state", help="ONLINE, LOST, ...")
    add("pools", cmd_pools, "pools the team may use")
    add("quota", cmd_quota, "the team's limits and usage")
    p = add("tokens", cmd_tokens, "API tokens: list, create NAME, revoke ID")
    p.add_argument("action", nargs="?", choices=["list", "create", "revoke"], default="list")
    p.add_argument("name", nargs="?", help="the new token's name (create) or a token id (revoke)")
    p.add_argument("--scope", action="append", help="read, write (create; default both)")
    p.add_argument("--expires-in-days", type=int)
    return parser


# -- entry point -----------------------------------------------------------------------------------
def _what(args: argparse.Namespace) -> str:
    if getattr(args, "id", None) is not None:
        return f"job {args.id}"
    if getattr(args, "command", "") == "statements" and getattr(args, "month", None):
        return f"statement {args.month}"
    return "not found"


def _translate(exc: errors.WhaleZenError, args: argparse.Namespace, url: str) -> CliError:
    if isinstance(exc, errors.Unreachable):
        return CliError(exc.message, EXIT_UNREACHABLE)
    if isinstance(exc, errors.NotSupported):
        return CliError(f"{exc.message} ({url} does not offer {exc.path} yet)", EXIT_API, status=exc.status)
    if isinstance(exc, errors.BadRequest):
        return CliError(f"refused: {exc.detail}", EXIT_USAGE, fields=exc.fields, status=exc.status)
    if isinstance(exc, errors.AuthError):
        return CliError(f"the server refused the token ({exc.detail}): run `whalezen login` or set WHALEZEN_TOKEN",
                        EXIT_AUTH, status=exc.status)
    if isinstance(exc, errors.Forbidden):
        return CliError(f"not allowed: {exc.detail}", EXIT_AUTH, status=exc.status)
    if isinstance(exc, errors.NotFound):
        what = _what(args)
        return CliError(what if what == "not found" else f"{what} not found", EXIT_NOT_FOUND, status=exc.status)
    if isinstance(exc, errors.Conflict):
        subject = f"{_what(args)}: " if getattr(args, "id", None) is not None else ""
        return CliError(f"{subject}{exc.detail}", EXIT_API, status=exc.status)
    if isinstance(exc, errors.Throttled):
        later = f"; retry in {exc.retry_after:g} s" if exc.retry_after else ""
        return CliError(f"too many requests ({exc.detail}){later}", EXIT_API, status=exc.status)
    if isinstance(exc, errors.ServerError):
        rid = f", request id {exc.request_id}" if exc.request_id else ""
        said = f": {exc.detail}" if exc.detail != f"HTTP {exc.status}" else ""
        return CliError(f"server error (HTTP {exc.status}{rid}){said}", EXIT_API, status=exc.status)
    if isinstance(exc, errors.ApiError):
        if 300 <= exc.status < 400:
            return CliError(exc.message, EXIT_API, status=exc.status)  # a redirect elsewhere, not followed
        return CliError(f"HTTP {exc.status}: {exc.detail}", EXIT_API, status=exc.status)
    return CliError(exc.message, EXIT_API)


def main(argv: Sequence[str] | None = None, *, env: Mapping[str, str] | None = None,
         stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    env = os.environ if env is None else env
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    parser = build_parser()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, its message on stderr)
        return int(exc.code or 0)
    out = Out(stdout, stderr, json_mode=bool(getattr(args, "json", False)))
    ctx = Context(args, env, out)
    try:
        try:
            return args.func(ctx)
        except config.NotLoggedIn as exc:
            raise CliError(str(exc), EXIT_AUTH) from None
        except errors.WhaleZenError as exc:
            url = ctx._client.url if ctx._client else (getattr(args, "url", None) or "the server")
            raise _translate(exc, args, url) from None
    except CliError as exc:
        out.clear_progress()
        stderr.write(f"whalezen: {exc.message}\n")
        stderr.flush()
        if out.json_mode:
            error: dict[str, Any] = {"message": exc.message, "exit_code": exc.code}
            if exc.status is not None:
                error["status"] = exc.status
            if exc.fields:
                error["fields"] = exc.fields
            out.json({"error": error}, compact=True)  # one line, also after JSON Lines (events --follow)
        return exc.code
    except KeyboardInterrupt:
        out.clear_progress()
        stderr.write("whalezen: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `whalezen ls | head`
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keep Python's exit flush quiet
        except OSError:
            pass
        return EXIT_OK


def entry() -> None:
    """The `whalezen` console script."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
