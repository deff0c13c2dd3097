"""A small fake of the Compute Engine REST API, enough for providers.gcp: instances
insert/get/list/aggregatedList/delete, zone operations get/wait, aggregated accelerator types.
There is no Compute Engine emulator, so we speak the real paths and JSON shapes here.

Knobs for tests: `fail_next_insert` (an operation error code such as
ZONE_RESOURCE_POOL_EXHAUSTED), `http_error_next_insert` ((status, reason)), `polls_until_done`
(how many operation reads before an insert finishes) and `accelerator_types`.
"""
from __future__ import annotations

import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

_PREFIX = "/compute/v1/projects/"
_FILTER_CLAUSE = re.compile(r'(labels\.[\w-]+|name|status)\s*(=|!=)\s*"?([^"\s)]+)"?')


@dataclass
class FakeGce:
    instances: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)  # (project, zone, name)
    operations: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    ops_by_request_id: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    pending_inserts: dict[tuple[str, str, str], tuple[dict[str, Any], int]] = field(default_factory=dict)
    requests: list[tuple[str, str, dict[str, list[str]], Any]] = field(default_factory=list)
    accelerator_types: dict[str, list[str]] = field(default_factory=dict)  # zone -> names
    fail_next_insert: str = ""
    http_error_next_insert: tuple[int, str] | None = None
    polls_until_done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    # -- helpers used by tests ------------------------------------------------------------
    def plant_instance(self, project: str, zone: str, name: str, *, labels: dict[str, str] | None = None,
                       created: str = "2026-01-01T00:00:00.000-00:00", status: str = "RUNNING") -> None:
        self.instances[(project, zone, name)] = {
            "kind": "compute#instance", "id": str(uuid.uuid4().int)[:18], "name": name, "status": status,
            "zone": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}",
            "machineType": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}/machineTypes/n1-standard-8",
            "labels": labels or {}, "creationTimestamp": created,
        }

    def calls(self, method: str, path_part: str) -> list[tuple[str, str, dict[str, list[str]], Any]]:
        return [r for r in self.requests if r[0] == method and path_part in r[1]]

    # -- operations ---------------------------------------------------------------------
    def _new_op(self, project: str, zone: str, kind: str, target: str, request_id: str, *, done: bool,
                error: str = "") -> dict[str, Any]:
        name = f"operation-{uuid.uuid4().hex[:16]}"
        op: dict[str, Any] = {
            "kind": "compute#operation", "id": str(uuid.uuid4().int)[:18], "name": name,
            "operationType": kind, "status": "DONE" if done else "RUNNING", "progress": 100 if done else 0,
            "targetLink": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}/instances/{target}",
            "zone": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}",
            "selfLink": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}/operations/{name}",
        }
        if error:
            op["error"] = {"errors": [{"code": error, "message": f"The zone '{zone}' does not have enough "
                                       "resources available to fulfill the request. (fake)"}]}
            op["httpErrorStatusCode"] = 503
            op["httpErrorMessage"] = "SERVICE UNAVAILABLE"
        self.operations[(project, zone, name)] = op
        if request_id:
            self.ops_by_request_id[request_id] = (project, zone, name)
        return op

    def _advance(self, project: str, zone: str, op_name: str) -> dict[str, Any] | None:
        key = (project, zone, op_name)
        op = self.operations.get(key)
        if op is None:
            return None
        if op["status"] != "DONE" and key in self.pending_inserts:
            instance, polls_left = self.pending_inserts[key]
            if polls_left <= 0:
                instance["status"] = "RUNNING"
                del self.pending_inserts[key]
                op.update(status="DONE", progress=100)
            else:
                self.pending_inserts[key] = (instance, polls_left - 1)
        return op

    # -- request handling ---------------------------------------------------------------
    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        with self.lock:
            self.requests.append((method, path, query, body))
            if not path.startswith(_PREFIX):
                return 404, _error(404, "notFound", f"no such path {path}")
            parts = path[len(_PREFIX):].split("/")
            project = parts[0]
            rest = parts[1:]
            if rest[:2] == ["aggregated", "instances"] and method == "GET":
                return 200, self._aggregated(project, query)
            if rest[:2] == ["aggregated", "acceleratorTypes"] and method == "GET":
                return 200, self._aggregated_accelerators(project)
            if len(rest) >= 3 and rest[0] == "zones":
                zone = rest[1]
                if rest[2] == "instances":
                    return self._instances(method, project, zone, rest[3:], query, body)
                if rest[2] == "operations" and len(rest) >= 4:
                    op = self._advance(project, zone, rest[3])
                    return (200, op) if op else (404, _error(404, "notFound", "operation not found"))
            return 404, _error(404, "notFound", f"no such path {path}")

    def _instances(self, method: str, project: str, zone: str, rest: list[str], query: dict[str, list[str]],
                   body: Any) -> tuple[int, Any]:
        request_id = query.get("requestId", [""])[0]
        if method == "POST" and not rest:
            if request_id in self.ops_by_request_id:  # same requestId: same operation, as GCE does
                return 200, self.operations[self.ops_by_request_id[request_id]]
            if self.http_error_next_insert:
                status, reason = self.http_error_next_insert
                self.http_error_next_insert = None
                return status, _error(status, reason, f"fake {reason}")
            name = body["name"]
            if (project, zone, name) in self.instances:
                return 409, _error(409, "alreadyExists",
                                   f"The resource 'projects/{project}/zones/{zone}/instances/{name}' already exists")
            if self.fail_next_insert:
                code, self.fail_next_insert = self.fail_next_insert, ""
                return 200, self._new_op(project, zone, "insert", name, request_id, done=True, error=code)
            instance = dict(body)
            instance.update(
                kind="compute#instance", id=str(uuid.uuid4().int)[:18], status="PROVISIONING",
                zone=f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}",
                creationTimestamp=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                networkInterfaces=[{"networkIP": "10.128.0.7", "accessConfigs": [{"natIP": "34.1.2.3"}]}],
            )
            self.instances[(project, zone, name)] = instance
            op = self._new_op(project, zone, "insert", name, request_id, done=False)
            self.pending_inserts[(project, zone, op["name"])] = (instance, self.polls_until_done)
            return 200, op
        if method == "GET" and not rest:
            items = [i for (p, z, _), i in self.instances.items() if p == project and z == zone]
            return 200, {"kind": "compute#instanceList", "items": _filtered(items, query)}
        if len(rest) == 1:
            key = (project, zone, rest[0])
            if key not in self.instances:
                return 404, _error(404, "notFound",
                                   f"The resource 'projects/{project}/zones/{zone}/instances/{rest[0]}' was not found")
            if method == "GET":
                return 200, self.instances[key]
            if method == "DELETE":
                if request_id in self.ops_by_request_id:
                    return 200, self.operations[self.ops_by_request_id[request_id]]
                del self.instances[key]
                return 200, self._new_op(project, zone, "delete", rest[0], request_id, done=True)
        return 400, _error(400, "badRequest", "unsupported call in fake")

    def _aggregated(self, project: str, query: dict[str, list[str]]) -> dict[str, Any]:
        by_zone: dict[str, list[dict[str, Any]]] = {}
        for (p, zone, _), instance in self.instances.items():
            if p == project:
                by_zone.setdefault(f"zones/{zone}", []).append(instance)
        items = {scope: {"instances": _filtered(insts, query)} for scope, insts in by_zone.items()}
        return {"kind": "compute#instanceAggregatedList", "items": {k: v for k, v in items.items() if v["instances"]}}

    def _aggregated_accelerators(self, project: str) -> dict[str, Any]:
        return {
            "kind": "compute#acceleratorTypeAggregatedList",
            "items": {
                f"zones/{zone}": {"acceleratorTypes": [
                    {"name": n, "zone": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}"}
                    for n in names]}
                for zone, names in self.accelerator_types.items()
            },
        }


def _filtered(items: list[dict[str, Any]], query: dict[str, list[str]]) -> list[dict[str, Any]]:
    text = query.get("filter", [""])[0].strip()
    if not text:
        return items
    clauses = _FILTER_CLAUSE.findall(text)
    if not clauses:
        raise ValueError(f"fake GCE cannot parse filter {text!r}")

    def keep(item: dict[str, Any]) -> bool:
        for field_name, op, value in clauses:
            actual = item.get("labels", {}).get(field_name[7:]) if field_name.startswith("labels.") else item.get(field_name)
            if (actual == value) != (op == "="):
                return False
        return True

    return [i for i in items if keep(i)]


def _error(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "errors": [{"reason": reason, "message": message}]}}


class _Handler(BaseHTTPRequestHandler):
    fake: FakeGce

    def _serve(self) -> None:
        url = urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        try:
            status, payload = self.server.fake.handle(self.command, url.path, parse_qs(url.query), body)  # type: ignore[attr-defined]
        except ValueError as exc:
            status, payload = 400, _error(400, "invalid", str(exc))
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass


class FakeGceServer:
    """Runs a FakeGce on 127.0.0.1 on a free port in a background thread."""

    def __init__(self) -> None:
        self.fake = FakeGce()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.fake = self.fake  # type: ignore[attr-defined]
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FakeGceServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
