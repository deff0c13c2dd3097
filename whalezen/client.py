"""A small typed client of WhaleZen's v1 API, on the standard library (urllib): one method per route.

    wz = Client("http://127.0.0.1:8000", token="wz_...")
    job = wz.submit({"name": "train", "command": ["python", "train.py"], "resources": {"gpus": 1}})
    for event in wz.iter_events(job["id"]): ...

- Results are the server's JSON, typed as the TypedDicts of `whalezen.types`.
- Errors are exceptions (`whalezen.errors`): 400 `BadRequest` (`.fields`: the API's field errors),
  401 `AuthError`, 403 `Forbidden`, 404 `NotFound`, 409 `Conflict`, 429 `Throttled`, 5xx `ServerError`,
  no answer `Unreachable`. A route this server does not have raises `NotSupported` (a `NotFound`).
- Every request has a timeout (`timeout_s`). Reads (GET) are retried a few times, with a short backoff,
  when the server cannot be reached (not when it timed out) or answers 502/503/504; a POST or PATCH is
  never retried (a submission that
  timed out may have been accepted: look at `jobs()` before sending it again).
"""
from __future__ import annotations

import json
import os
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

from whalezen import errors
from whalezen.types import (Budget, Checkpoint, CostReport, GpuModel, Job, JobEvent, Migration, Node, Page, PendingReason,
                            Pool, Quota, Quote, Savings, Statement, Token, TokenCreated)

API_PREFIX = "/api/v1"
DEFAULT_TIMEOUT_S = 30.0
USER_AGENT = "whalezen-client/0.1.0"
RETRY_STATUSES = (502, 503, 504)
MAX_PAGE_SIZE = 500  # the API's largest page


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to the same scheme, host and port: urllib would otherwise send the
    token (`Authorization`) along to wherever a Location header points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        old, new = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if (old.scheme, old.netloc) != (new.scheme, new.netloc):
            return None  # urllib then raises the 3xx as an HTTPError
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_SameOriginRedirects)


def normalise_url(url: str) -> str:
    """`http://host:8000/`, `http://host:8000/api/v1/` -> `http://host:8000` (or raise ValueError)."""
    url = (url or "").strip()
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"server URL must look like http://host:port, not {url!r}")
    path = parts.path.rstrip("/")
    if path.endswith(API_PREFIX):
        path = path[: -len(API_PREFIX)]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class Client:
    """One server and one token. Thread-safe: it keeps no state between requests."""

    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 retries: int = 2, backoff_s: float = 0.3, user_agent: str = USER_AGENT) -> None:
        self.url = normalise_url(url)
        self.token = token
        self.timeout_s = timeout_s
        self.retries = max(0, retries)
        self.backoff_s = backoff_s
        self.user_agent = user_agent

    @classmethod
    def from_login(cls, **kwargs: Any) -> "Client":
        """The login `whalezen login` stored, with `WHALEZEN_URL` / `WHALEZEN_TOKEN` taking precedence."""
        from whalezen.config import resolve_login

        login = resolve_login()
        return cls(login.url, login.token, **kwargs)

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    # -- jobs --------------------------------------------------------------------------------------
    def jobs(self, *, state: str | Sequence[str] | None = None, name: str | None = None,
             priority: int | None = None, priority_min: int | None = None, priority_max: int | None = None,
             created_after: str | None = None, created_before: str | None = None, page: int | None = None,
             page_size: int | None = None) -> Page[Job]:
        """One page of the team's jobs, newest first, with the API's filters."""
        params = {"state": state, "name": name, "priority": priority, "priority_min": priority_min,
                  "priority_max": priority_max, "created_after": created_after, "created_before": created_before,
                  "page": page, "page_size": page_size}
        return cast(Page[Job], self._get("/jobs/", params))

    def iter_jobs(self, **filters: Any) -> Iterator[Job]:
        """Every job that matches `filters` (see `jobs`), page after page."""
        yield from self._iter_pages("/jobs/", filters)

    def job(self, job_id: int) -> Job:
        return cast(Job, self._get(f"/jobs/{_id(job_id)}/"))

    def submit(self, spec: Mapping[str, Any], *, format: str | None = None) -> Job:
        """Submit a job spec (our own, a SkyPilot task file or a Kubernetes manifest, as a parsed
        document; `format` declares which, else the server tells by its shape). The answer has the job,
        plus `format` and the `warnings` about fields that do not change a batch run. Not retried: a
        timeout may still have created the job."""
        params = {"spec_format": format} if format else None
        return cast(Job, self._request("POST", "/jobs/", params=params, body=dict(spec)))

    def submit_dry_run(self, spec: Mapping[str, Any], *, format: str | None = None) -> dict[str, Any]:
        """Validate and normalise `spec` without creating anything: {format, spec, demand, warnings,
        problems}; `problems` would block a real submission (an env value still to supply)."""
        params = {"dry_run": "1", **({"spec_format": format} if format else {})}
        return cast(dict, self._request("POST", "/jobs/", params=params, body=dict(spec)))

    def upload(self, archive: str | os.PathLike[str], *, kind: str = "tree", sha256: str | None = None
               ) -> dict[str, Any]:
        """Upload a tar.gz (`POST /api/v1/uploads/`, streamed from the file): {id, sha256, size_bytes, ...};
        name it in a job's files as `upload:<id>`. kind "file": the archive holds one file, written at
        the destination itself. Not retried."""
        url = self.url + API_PREFIX + "/uploads/" + _query({"kind": kind})
        size = os.path.getsize(archive)
        headers = {"Accept": "application/json", "User-Agent": self.user_agent, "Content-Type": "application/gzip",
                   "Content-Length": str(size)}
        if sha256:
            headers["X-Content-SHA256"] = sha256
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        with open(archive, "rb") as body:
            return cast(dict, self._once("POST", url, "/uploads/", body, headers))  # type: ignore[arg-type]

    def cancel(self, job_id: int) -> Job:
        return cast(Job, self._post(f"/jobs/{_id(job_id)}/cancel/"))

    def checkpoint(self, job_id: int) -> Job:
        """Ask the running job for a checkpoint now (the job is CHECKPOINTING until one is committed)."""
        return cast(Job, self._post(f"/jobs/{_id(job_id)}/checkpoint/"))

    def migrate(self, job_id: int, *, pool: str | None = None, node: str | None = None) -> Migration:
        """Move the running job by checkpoint: to a node, into a pool, or (neither) anywhere else."""
        body = {k: v for k, v in (("pool", pool), ("node", node)) if v}
        return cast(Migration, self._post(f"/jobs/{_id(job_id)}/migrate/", body))

    def events(self, job_id: int, *, page: int | None = None, page_size: int | None = None) -> Page[JobEvent]:
        """One page of the job's append-only event log, oldest first."""
        return cast(Page[JobEvent], self._get(f"/jobs/{_id(job_id)}/events/", {"page": page, "page_size": page_size}))

    def iter_events(self, job_id: int, *, skip: int = 0) -> Iterator[JobEvent]:
        """The job's events from the `skip`-th on (events are only ever appended, so a caller that has
        seen n of them asks with skip=n next time)."""
        page_no = skip // MAX_PAGE_SIZE + 1
        offset = skip % MAX_PAGE_SIZE
        while True:
            page = self.events(job_id, page=page_no, page_size=MAX_PAGE_SIZE)
            yield from page["results"][offset:]
            if not page.get("next") or not page["results"]:
                return
            page_no, offset = page_no + 1, 0

    def checkpoints(self, job_id: int) -> list[Checkpoint]:
        return list(self._iter_pages(f"/jobs/{_id(job_id)}/checkpoints/", {}))

    def migrations(self, job_id: int) -> list[Migration]:
        return list(self._iter_pages(f"/jobs/{_id(job_id)}/migrations/", {}))

    def explain(self, job_id: int) -> PendingReason | None:
        """Why the job waits: the engine's reason (`code`, `message`, `data` with the numbers), or None
        when it is not pending."""
        return self.job(job_id)["pending_reason"]

    def logs(self, job_id: int) -> str:
        """The end of the job's output. From `GET .../logs/` where the server has it; otherwise the
        output tail its node's agent reported (in the job's events, when a run ended)."""
        job_id = _id(job_id)
        try:
            body = self._request("GET", f"/jobs/{job_id}/logs/", accept="text/plain, application/json")
        except errors.NotFound:
            self.job(job_id)  # a job that is not there (or another team's) raises NotFound here
            tails = [e["data"]["output_tail"] for e in self.iter_events(job_id)
                     if isinstance(e.get("data"), dict) and isinstance(e["data"].get("output_tail"), str)]
            return tails[-1] if tails else ""
        if isinstance(body, dict):
            return str(body.get("output") or body.get("tail") or body.get("log") or "")
        return str(body)

    # -- capacity and limits -----------------------------------------------------------------------
    def nodes(self, *, state: str | None = None, pool: int | None = None) -> list[Node]:
        return list(self._iter_pages("/nodes/", {"state": state, "pool": pool}))

    def node(self, node_id: int) -> Node:
        return cast(Node, self._get(f"/nodes/{_id(node_id)}/"))

    def pools(self) -> list[Pool]:
        return list(self._iter_pages("/pools/", {}))

    def pool(self, pool_id: int) -> Pool:
        return cast(Pool, self._get(f"/pools/{_id(pool_id)}/"))

    def gpu_models(self) -> list[GpuModel]:
        return list(self._iter_pages("/gpu-models/", {}))

    def quota(self) -> Quota:
        return cast(Quota, self._get("/quota/"))

    # -- tokens ------------------------------------------------------------------------------------
    def tokens(self) -> list[Token]:
        return list(self._iter_pages("/tokens/", {}))

    def create_token(self, name: str, *, scopes: Sequence[str] | None = None,
                     expires_in_days: int | None = None) -> TokenCreated:
        """A new token; its secret (`token`) is in this answer only."""
        body: dict[str, Any] = {"name": name}
        if scopes:
            body["scopes"] = list(scopes)
        if expires_in_days:
            body["expires_in_days"] = expires_in_days
        return cast(TokenCreated, self._post("/tokens/", body))

    def revoke_token(self, token_id: int) -> Token:
        return cast(Token, self._post(f"/tokens/{_id(token_id)}/revoke/"))

    # -- money (issue 13: a server without billing answers NotSupported) --------------------------
    def costs(self, *, group_by: str | Sequence[str] | None = None, from_: str | None = None,
              to: str | None = None, team: str | None = None) -> CostReport:
        """`GET /api/v1/costs/`: rows per group (`team`, `user`, `job`, `gpu_model`, `provider`, `pool`,
        `region`, `day`, or several) with `gpu_hours`, `cost`, `idle_cost`, `avg_gpu_utilisation`.
        `team` (platform admins): another team's slug, or `all`."""
        body = self._feature("costs", "GET", "/costs/", params=_cost_params(group_by, from_, to, team))
        if isinstance(body, list):
            return {"rows": body}
        return cast(CostReport, body)

    def costs_csv(self, *, group_by: str | Sequence[str] | None = None, from_: str | None = None,
                  to: str | None = None, team: str | None = None) -> str:
        params = _cost_params(group_by, from_, to, team) | {"format": "csv"}
        return str(self._feature("costs", "GET", "/costs/", params=params, accept="text/csv"))

    def quote(self, spec: Mapping[str, Any]) -> Quote:
        """`POST /api/v1/quotes/` with a job spec: the cheapest feasible options, each with where, on-demand
        or spot, the expected cost and when it could start. Nothing is submitted."""
        body = self._feature("quotes", "POST", "/quotes/", body=dict(spec))
        if isinstance(body, list):
            return {"options": body}
        return cast(Quote, body)

    def budget(self) -> Budget:
        """This month's budget, spend, the 80% warning and alerts (`GET /api/v1/budget/`)."""
        return cast(Budget, self._feature("budget", "GET", "/budget/"))

    def set_budget(self, monthly_budget_usd: str | float | None) -> Budget:
        """Change the team's monthly budget (team admins; None: no budget). Not retried."""
        value = None if monthly_budget_usd is None else str(monthly_budget_usd)
        return cast(Budget, self._feature("budget", "PATCH", "/budget/", body={"monthly_budget_usd": value}))

    def statements(self, *, team: str | None = None) -> list[Statement]:
        """The team's monthly statements (team admins; a platform admin may name another `team`)."""
        body = self._feature("statements", "GET", "/statements/", params={"team": team} if team else None)
        if isinstance(body, dict) and "results" in body:
            return list(body["results"])
        return list(body) if isinstance(body, list) else [body]

    def statement(self, month: str, *, csv: bool = False, team: str | None = None) -> Statement | str:
        """One month's statement (`YYYY-MM`), or its CSV text (`team`: as for `statements`)."""
        params = ({"format": "csv"} if csv else {}) | ({"team": team} if team else {}) or None
        return self._feature("statements", "GET", f"/statements/{_month(month)}/", params=params,
                             accept="text/csv" if csv else "application/json", item_of="/statements/")

    def savings(self, *, from_: str | None = None, to: str | None = None) -> Savings:
        """`GET /api/v1/costs/savings/`: per job, what it cost against the cheapest single-cloud
        on-demand offer of its GPU model, and the totals."""
        return cast(Savings, self._feature("savings", "GET", "/costs/savings/", params={"from": from_, "to": to}))

    # -- transport ---------------------------------------------------------------------------------
    def _get(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        return self._request("GET", path, params=params)

    def _post(self, path: str, body: Any = None) -> Any:
        return self._request("POST", path, body=body)

    def _iter_pages(self, path: str, params: Mapping[str, Any]) -> Iterator[Any]:
        page_no = 1
        while True:
            body = self._get(path, {**params, "page": page_no, "page_size": MAX_PAGE_SIZE})
            if isinstance(body, list):  # an unpaginated route
                yield from body
                return
            yield from body["results"]
            if not body.get("next") or not body["results"]:
                return
            page_no += 1

    def _feature(self, feature: str, method: str, path: str, *, params: Mapping[str, Any] | None = None,
                 body: Any = None, accept: str = "application/json", item_of: str | None = None) -> Any:
        """A call to a route a server may not have yet: its 404 becomes NotSupported, unless `item_of`
        (the collection the path is an item of) exists, so that it is the object that is missing (a month
        with no statement)."""
        try:
            return self._request(method, path, params=params, body=body, accept=accept)
        except errors.NotSupported:
            raise
        except errors.NotFound as exc:
            if item_of and self._has_route(item_of):
                raise
            raise errors.NotSupported(feature, status=exc.status, body=exc.body, request_id=exc.request_id,
                                      method=method, path=path) from None

    def _has_route(self, path: str) -> bool:
        try:
            self._request("GET", path)
        except errors.NotFound:
            return False
        except errors.ApiError:
            return True
        return True

    def _request(self, method: str, path: str, *, params: Mapping[str, Any] | None = None, body: Any = None,
                 accept: str = "application/json") -> Any:
        url = self.url + API_PREFIX + path + _query(params)
        headers = {"Accept": accept, "User-Agent": self.user_agent}
        data = None
        if body is not None:
            data = json.dumps(body, allow_nan=False).encode()
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        attempts = 1 + (self.retries if method == "GET" else 0)
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                return self._once(method, url, path, data, headers)
            except errors.Unreachable as exc:
                if last or exc.timed_out:  # a server that is slow to answer is not asked again at once
                    raise
            except errors.ServerError as exc:
                if last or exc.status not in RETRY_STATUSES:
                    raise
            time.sleep(self.backoff_s * (2 ** attempt))
        raise AssertionError("unreachable")  # the loop returns or raises

    def _once(self, method: str, url: str, path: str, data: bytes | None, headers: dict[str, str]) -> Any:
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with _OPENER.open(request, timeout=self.timeout_s) as response:
                raw = response.read()
                return _decode(raw, response.headers.get("Content-Type", ""))
        except urllib.error.HTTPError as err:
            raw = err.read() if err.fp is not None else b""
            body = _decode(raw, err.headers.get("Content-Type", "") if err.headers else "")
            raise _api_error(method, path, err.code, body, err.headers) from None
        except (TimeoutError, socket.timeout) as exc:
            raise errors.Unreachable(f"{self.url} did not answer within {self.timeout_s:g} s", url=self.url,
                                     timed_out=True) from exc
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise errors.Unreachable(f"{self.url} did not answer within {self.timeout_s:g} s", url=self.url,
                                         timed_out=True) from exc
            raise errors.Unreachable(f"cannot reach {self.url}: {_reason(reason)}", url=self.url) from exc
        except (ConnectionError, ssl.SSLError, OSError) as exc:
            raise errors.Unreachable(f"cannot reach {self.url}: {_reason(exc)}", url=self.url) from exc


def _api_error(method: str, path: str, status: int, body: Any, headers: Any) -> errors.ApiError:
    request_id = headers.get("X-Request-ID") if headers else None
    kwargs = {"status": status, "body": body, "request_id": request_id, "method": method, "path": path}
    detail = errors.describe_body(body) or f"HTTP {status}"
    if status == 400:
        return errors.BadRequest(detail, **kwargs)
    if status == 401:
        return errors.AuthError(detail, **kwargs)
    if status == 403:
        return errors.Forbidden(detail, **kwargs)
    if status == 404:
        return errors.NotFound(detail, **kwargs)
    if status == 409:
        return errors.Conflict(detail, **kwargs)
    if status == 429:
        retry_after = headers.get("Retry-After") if headers else None
        try:
            seconds = float(retry_after) if retry_after else None
        except ValueError:
            seconds = None
        return errors.Throttled(detail, retry_after=seconds, **kwargs)
    if status >= 500:
        return errors.ServerError(detail, **kwargs)
    if 300 <= status < 400:
        where = headers.get("Location") if headers else None
        return errors.ApiError(f"HTTP {status}: the server redirects to {where or 'elsewhere'}; not followed "
                               "(use that server's URL)", **kwargs)
    return errors.ApiError(detail, **kwargs)


def _decode(raw: bytes, content_type: str) -> Any:
    text = raw.decode("utf-8", errors="replace")
    if "json" in content_type or (not content_type and text[:1] in "{["):
        try:
            return json.loads(text) if text else None
        except ValueError:
            return text
    return text


def _reason(reason: Any) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, socket.gaierror):
        return "unknown host"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason) or type(reason).__name__


def _query(params: Mapping[str, Any] | None) -> str:
    if not params:
        return ""
    pairs: list[tuple[str, str]] = []
    for key, value in params.items():
        if value is None or value == "":
            continue
        if isinstance(value, (list, tuple)):
            pairs.extend((key, str(v)) for v in value)
        elif isinstance(value, bool):
            pairs.append((key, "true" if value else "false"))
        else:
            pairs.append((key, str(value)))
    return "?" + urllib.parse.urlencode(pairs) if pairs else ""


def _id(value: Any) -> int:
    """Path ids are positive integers: `1`, `"17"`; anything else is a ValueError, never a path."""
    text = str(value).strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"an id is a positive whole number, not {value!r}")
    return int(text)


def _month(value: str) -> str:
    text = str(value).strip()
    if len(text) != 7 or text[4] != "-" or not (text[:4] + text[5:]).isdigit():
        raise ValueError(f"a month is YYYY-MM, not {value!r}")
    return text


def _cost_params(group_by: str | Sequence[str] | None, from_: str | None, to: str | None,
                 team: str | None = None) -> dict[str, Any]:
    if isinstance(group_by, (list, tuple)):
        group_by = ",".join(group_by)
    return {"group_by": group_by, "from": from_, "to": to, "team": team}
