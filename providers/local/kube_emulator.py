"""An in-memory Kubernetes API server, built on kmock's KubernetesEmulator: the tests' cluster and the demo's.

kmock is a development dependency (requirements-dev.txt, which `make setup` installs): only the tests and the
`make run` demo cluster (providers/local/kube_sim.py) import this module.

The code under test (agent/kube/) is synchronous and talks to the cluster through the
official `kubernetes` client, so the emulator runs a real HTTP server on 127.0.0.1 in a
background thread with its own asyncio loop.  Tests play kube-scheduler and kubelet
through the synchronous helpers of `EmulatedCluster`; every helper change reaches
watchers as a MODIFIED/DELETED event, exactly like an API write.

kmock's emulator is used for storage, create/patch/delete and finalizers; this module
fixes what a client of a real apiserver relies on (see _Emulator's docstring).
"""
from __future__ import annotations

import asyncio
import copy
import datetime
import json
import logging
import re
import secrets
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import attrs
from kmock._internal import enums, k8s, references, rendering

# One access-log line per request (every watch restart included) would drown a failing test's output.
logging.getLogger("aiohttp.access").setLevel(logging.WARNING)

PODS = references.resource(group="", version="v1", plural="pods")
NODES = references.resource(group="", version="v1", plural="nodes")
EVENTS = references.resource(group="", version="v1", plural="events")

# Kinds the client expects in list answers; unknown plurals fall back to a guess.
_KINDS = {"pods": "Pod", "nodes": "Node", "events": "Event", "namespaces": "Namespace",
          "services": "Service", "configmaps": "ConfigMap", "secrets": "Secret"}

Obj = dict[str, Any]


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    """A metav1.Status body, which the client turns into ApiException(status=code)."""
    return aiohttp.web.json_response({
        "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
        "code": code, "reason": reason, "message": message,
    }, status=code)


# ---------------------------------------------------------------- selectors

_LABEL_TERM = re.compile(
    r"^\s*(?:(?P<not>!)\s*(?P<nkey>[^\s=!,()]+)"
    r"|(?P<key>[^\s=!,()]+)\s*(?:(?P<op>==|=|!=)\s*(?P<val>[^\s,()]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<vals>[^)]*)\))?)\s*$")


def _split_terms(selector: str) -> list[str]:
    """Split on commas that are not inside `in (a,b)` parentheses."""
    terms, depth, cur = [], 0, ""
    for ch in selector:
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    terms.append(cur)
    return [t for t in terms if t.strip()]


def label_selector_matches(selector: str | None, labels: Mapping[str, str] | None) -> bool:
    """Equality-based and set-based label selectors, as `kubectl -l` accepts them."""
    labels = labels or {}
    for term in _split_terms(selector or ""):
        m = _LABEL_TERM.match(term)
        if m is None:
            raise ValueError(f"unsupported label selector term: {term!r}")
        if m["not"]:
            if m["nkey"] in labels:
                return False
        elif m["op"]:
            equal = labels.get(m["key"]) == m["val"]
            if equal != (m["op"] != "!="):
                return False
        elif m["setop"]:
            vals = {v.strip() for v in m["vals"].split(",")}
            inside = m["key"] in labels and labels[m["key"]] in vals
            if inside != (m["setop"] == "in"):
                return False
        elif m["key"] not in labels:
            return False
    return True


def _field(obj: Obj, path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def field_selector_matches(selector: str | None, obj: Obj) -> bool:
    """`a.b=x`, `a.b==x`, `a.b!=x` terms joined by commas (missing fields read as "")."""
    for term in _split_terms(selector or ""):
        m = re.match(r"^\s*([\w.]+)\s*(==|=|!=)\s*(.*?)\s*$", term)
        if m is None:
            raise ValueError(f"unsupported field selector term: {term!r}")
        equal = _field(obj, m[1]) == m[3]
        if equal != (m[2] != "!="):
            return False
    return True


# ---------------------------------------------------------------- the async server

class _Fanout:
    """Stands in for kmock's per-resource event bus: the parent class only calls put().

    Every event is deep-copied (kmock hands out live dicts), kept in a history so that
    a watch started from a resourceVersion replays what it missed, and pushed to the
    queue of every open watch.
    """

    def __init__(self) -> None:
        self.history: list[tuple[int, Obj]] = []
        self.watchers: set[asyncio.Queue[Obj | None]] = set()

    async def put(self, *events: Obj) -> None:
        for event in events:
            event = copy.deepcopy(event)
            rv = int(event["object"].get("metadata", {}).get("resourceVersion") or 0)
            self.history.append((rv, event))
            for queue in self.watchers:
                queue.put_nowait(event)


@attrs.define(kw_only=True)
class _Emulator(k8s.KubernetesEmulator):
    """kmock's emulator, with what the bridge needs from a real apiserver added:

    namespace from the URL written into created bodies (kmock matches watch events on
    it); uid, creationTimestamp and a cluster-wide resourceVersion bumped on every
    change; new Pods get status.phase=Pending; lists of kinds with no objects are empty
    lists, not 404; label and field selectors on lists and watches; timeoutSeconds and
    resourceVersion on watches; GET /version/; PUT (replace); pods/NAME/log; and a
    switch that makes cluster-wide pod list/watch answer 403 like RBAC does.
    """

    _buses: Any = attrs.field(factory=lambda: defaultdict(_Fanout))
    rv: int = 0
    logs: dict[tuple[str, str], str] = attrs.field(factory=dict)
    forbid_all_namespaces_pods: bool = False
    closing: bool = False

    def next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def fanout(self, resource: references.resource) -> _Fanout:
        return self._buses[resource]

    def live(self, resource: references.resource) -> Iterator[tuple[str | None, str, Obj]]:
        for (res, namespace, name), obj in list(self._objects.items()):
            if res == resource and not obj.deleted:
                yield namespace, name, obj.raw

    def stamp_new(self, resource: references.resource, namespace: str | None, body: Obj) -> Obj:
        """Fill what the apiserver sets on create; returns the body to store."""
        meta = body.setdefault("metadata", {})
        if namespace is not None:
            meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = self.next_rv()
        meta.setdefault("creationTimestamp", _now())
        if resource.plural == "pods":
            body.setdefault("status", {}).setdefault("phase", "Pending")
        return body

    # -- storage operations shared by the API paths and the test helpers (call under lock)

    async def store_new(self, resource: references.resource, namespace: str | None, body: Obj) -> Obj:
        body = self.stamp_new(resource, namespace, body)
        key = (resource, namespace, body["metadata"]["name"])
        if key in self._objects and not self._objects[key].deleted:
            raise k8s.KubernetesObjectConflictError(
                reason="AlreadyExists", message=f'{resource.plural} "{key[2]}" already exists')
        if key in self._objects:
            self._objects[key].create(body)
        else:
            self._objects[key] = body
        await self._buses[resource].put({"type": "ADDED", "object": self._objects[key].raw})
        return copy.deepcopy(self._objects[key].raw)

    def existing(self, resource: references.resource, namespace: str | None, name: str) -> Any:
        key = (resource, namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            raise k8s.KubernetesObjectNotFoundError(
                reason="NotFound", message=f'{resource.plural} "{name}" not found')
        return self._objects[key]

    async def store_patch(self, resource: references.resource, namespace: str | None, name: str,
                          patch: Obj) -> Obj:
        obj = self.existing(resource, namespace, name)
        patch = copy.deepcopy(patch)
        patch.setdefault("metadata", {})["resourceVersion"] = self.next_rv()
        obj.patch(patch)
        await self._buses[resource].put({"type": "MODIFIED", "object": obj.raw})
        return copy.deepcopy(obj.raw)

    async def store_delete(self, resource: references.resource, namespace: str | None, name: str) -> None:
        obj = self.existing(resource, namespace, name)
        obj.patch({"metadata": {"resourceVersion": self.next_rv()}})
        raw = obj.raw
        obj.delete()
        await self._buses[resource].put({"type": "DELETED", "object": raw})

    # -- HTTP

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path
        if request.method == enums.method.GET and path.rstrip("/") == "/version":
            return aiohttp.web.json_response({
                "major": "1", "minor": "31", "gitVersion": "v1.31.0-whalezen-emulated",
                "gitCommit": "0" * 40, "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
                "goVersion": "go1.22", "compiler": "gc", "platform": "linux/amd64"})
        resource = request.resource
        if resource is None:
            return await super()._handle(request)
        # The python client sends watch=True; kmock only recognises watch=true.
        watching = request.method == enums.method.GET and request.params.get("watch", "").lower() in ("true", "1")
        if (self.forbid_all_namespaces_pods and resource == PODS and request.namespace is None
                and request.method == enums.method.GET and request.name is None):
            verb = "watch" if watching else "list"
            return _status(403, "Forbidden",
                           f'pods is forbidden: User "system:serviceaccount:whalezen:bridge" cannot {verb}'
                           ' resource "pods" in API group "" at the cluster scope')
        try:
            if resource == PODS and request.subresource == "log" and request.method == enums.method.GET:
                return await self._serve_log(request)
            if watching:
                return await self._watch(request)
            if request.action == enums.action.LIST:
                return await self._list(request)
            if request.method == enums.method.PUT and request.name and not request.subresource:
                return await self._replace(request)
            if request.action == enums.action.CREATE and not request.subresource:
                async with self._lock:
                    if resource == PODS and not (request.data or {}).get("spec", {}).get("containers"):
                        return _status(422, "Invalid", "Pod is invalid: spec.containers: Required value")
                    created = await self.store_new(resource, request.namespace, dict(request.data or {}))
                return aiohttp.web.json_response(created, status=201)
            if request.action == enums.action.UPDATE and request.name:
                if not isinstance(request.data, dict):
                    return _status(415, "UnsupportedMediaType",
                                   "the emulator takes merge / strategic-merge patches only (a JSON object)")
                async with self._lock:
                    patched = await self.store_patch(resource, request.namespace, request.name, request.data)
                return aiohttp.web.json_response(patched)
            if request.action == enums.action.DELETE and request.name:
                async with self._lock:
                    obj = self.existing(resource, request.namespace, request.name)
                    if not obj.get("metadata", {}).get("finalizers"):
                        # kmock's own path would emit DELETED with a stale resourceVersion.
                        raw = copy.deepcopy(obj.raw)
                        await self.store_delete(resource, request.namespace, request.name)
                        return aiohttp.web.json_response(raw)
                    obj.patch({"metadata": {"resourceVersion": self.next_rv()}})
        except k8s.KubernetesError as e:
            return _status(e.status, e.reason or "Error", e.message or "")
        return await super()._handle(request)

    def _matching(self, request: rendering.Request, obj: Obj) -> bool:
        meta = obj.get("metadata", {})
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        if request.name is not None and meta.get("name") != request.name:
            return False
        return (label_selector_matches(request.params.get("labelSelector"), meta.get("labels"))
                and field_selector_matches(request.params.get("fieldSelector"), obj))

    async def _list(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        assert request.resource is not None
        async with self._lock:
            try:
                items = [copy.deepcopy(raw) for _, _, raw in self.live(request.resource)
                         if self._matching(request, raw)]
            except ValueError as e:
                return _status(400, "BadRequest", str(e))
            rv = str(self.rv)
        kind = _KINDS.get(request.resource.plural or "", (request.resource.plural or "").capitalize())
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        return aiohttp.web.json_response({"apiVersion": "v1", "kind": f"{kind}List",
                                          "metadata": {"resourceVersion": rv}, "items": items})

    async def _watch(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        assert request.resource is not None and request._raw_request is not None
        fanout = self.fanout(request.resource)
        queue: asyncio.Queue[Obj | None] = asyncio.Queue()
        since = request.params.get("resourceVersion") or "0"
        async with self._lock:
            fanout.watchers.add(queue)  # under the lock: no change slips between snapshot and stream
            if since == "0":
                backlog = [{"type": "ADDED", "object": copy.deepcopy(raw)}
                           for _, _, raw in self.live(request.resource)]
            else:
                backlog = [event for rv, event in fanout.history if rv > int(since)]
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        response = aiohttp.web.StreamResponse()
        response.content_type = "application/json"
        await response.prepare(request._raw_request)
        try:
            for event in backlog:
                if self._matching(request, event["object"]):
                    await response.write(json.dumps(event).encode() + b"\n")
            while not self.closing:
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    event = await asyncio.wait_for(queue.get(), remaining)
                except TimeoutError:
                    break
                if event is None:  # the cluster is stopping
                    break
                if self._matching(request, event["object"]):
                    await response.write(json.dumps(event).encode() + b"\n")
        except (ConnectionResetError, ValueError):
            pass  # the client went away, or sent a selector we cannot parse
        finally:
            fanout.watchers.discard(queue)
        await response.write_eof()
        return response

    async def _replace(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        assert request.resource is not None and request.name is not None
        body = dict(request.data or {})
        async with self._lock:
            obj = self.existing(request.resource, request.namespace, request.name)
            old_meta = obj.raw.get("metadata", {})
            sent_rv = body.get("metadata", {}).get("resourceVersion")
            if sent_rv and sent_rv != old_meta.get("resourceVersion"):
                return _status(409, "Conflict", "the object has been modified; please apply your changes"
                               " to the latest version and try again")
            meta = body.setdefault("metadata", {})
            for kept in ("uid", "creationTimestamp", "namespace", "name"):
                if kept in old_meta:
                    meta[kept] = old_meta[kept]
            meta["resourceVersion"] = self.next_rv()
            obj.create(body)  # a new version that replaces, not merges
            await self._buses[request.resource].put({"type": "MODIFIED", "object": obj.raw})
            return aiohttp.web.json_response(copy.deepcopy(obj.raw))

    async def _serve_log(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        assert request.name is not None
        async with self._lock:
            self.existing(PODS, request.namespace, request.name)
            text = self.logs.get((request.namespace or "", request.name), "")
        tail = request.params.get("tailLines")
        if tail is not None:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(tail):]) if int(tail) > 0 else ""
        return aiohttp.web.Response(text=text, content_type="text/plain")

    async def shutdown_watches(self) -> None:
        self.closing = True
        for fanout in list(self._buses.values()):
            for queue in list(fanout.watchers):
                queue.put_nowait(None)


# ---------------------------------------------------------------- the synchronous face

def _container_state(phase: str, exit_code: int | None, reason: str | None,
                     message: str | None) -> tuple[Obj, bool]:
    """containerStatuses[0].state for a pod phase, and whether the container is ready."""
    now = _now()
    if phase == "Running":
        return {"running": {"startedAt": now}}, True
    if phase in ("Succeeded", "Failed"):
        code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
        term: Obj = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                     "startedAt": now, "finishedAt": now}
        if message:
            term["message"] = message
        return {"terminated": term}, False
    waiting: Obj = {"reason": reason or "ContainerCreating"}
    if message:
        waiting["message"] = message
    return {"waiting": waiting}, False


def _with_condition(status: Obj, condition: Obj) -> list[Obj]:
    conditions = [c for c in status.get("conditions") or [] if c.get("type") != condition["type"]]
    return conditions + [dict(condition, lastTransitionTime=_now(), lastProbeTime=None)]


def _parse_taint(taint: str | Mapping[str, str]) -> Obj:
    """"key=value:Effect" / "key:Effect" or a ready dict."""
    if isinstance(taint, Mapping):
        return dict(taint)
    key_value, _, effect = taint.partition(":")
    key, _, value = key_value.partition("=")
    out: Obj = {"key": key, "effect": effect or "NoSchedule"}
    if value:
        out["value"] = value
    return out


class EmulatedCluster:
    """One emulated apiserver on 127.0.0.1:PORT, in its own thread and asyncio loop."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kube-emulator", daemon=True)
        self._thread.start()
        self._emulator: _Emulator = self._call(self._start)
        self.url: str = f"http://127.0.0.1:{self._server.port}"

    async def _start(self) -> _Emulator:
        emulator = _Emulator()
        await emulator.__aenter__()  # collects handler errors instead of dropping connections
        self._server = aiohttp.test_utils.RawTestServer(emulator, host="127.0.0.1", port=None)
        await self._server.start_server()
        return emulator

    def _call(self, fn: Callable[..., Any], *args: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(*args), self._loop).result(timeout)

    def _locked(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            async with self._emulator._lock:
                return await fn()
        return self._call(run)

    # -- client setup

    def write_kubeconfig(self, path: str | Path, *, context: str = "emulated",
                         namespace: str = "default") -> Path:
        return write_kubeconfig(path, {context: self}, namespace=namespace)

    # -- objects

    def add_node(self, name: str, *, gpus: int = 0, product: str = "NVIDIA-H100-80GB-HBM3",
                 memory_mib: int = 81559, labels: Mapping[str, str] | None = None,
                 taints: Iterable[str | Mapping[str, str]] = (), ready: bool = True,
                 cpu: str = "64", memory: str = "512Gi") -> Obj:
        """A Node as the NVIDIA GPU operator labels it (GPU labels only when gpus > 0)."""
        node_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}
        resources = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "1Ti"}
        if gpus:
            node_labels.update({"nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": str(memory_mib),
                                "nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.present": "true"})
            resources["nvidia.com/gpu"] = str(gpus)
        node_labels.update(labels or {})
        body: Obj = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": node_labels},
            "spec": {"taints": [_parse_taint(t) for t in taints]},
            "status": {"capacity": dict(resources), "allocatable": dict(resources),
                       "conditions": [self._ready_condition(ready)],
                       "addresses": [{"type": "Hostname", "address": name}]},
        }
        return self._locked(lambda: self._emulator.store_new(NODES, None, body))

    @staticmethod
    def _ready_condition(ready: bool) -> Obj:
        return {"type": "Ready", "status": "True" if ready else "False",
                "reason": "KubeletReady" if ready else "KubeletNotReady",
                "message": "kubelet is posting ready status" if ready else "kubelet stopped posting node status",
                "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}

    def set_node_ready(self, name: str, ready: bool) -> Obj:
        node = self.node(name)
        assert node is not None, f"no node {name}"
        conditions = [c for c in node["status"].get("conditions", []) if c["type"] != "Ready"]
        return self.patch(NODES, None, name, {"status": {"conditions": conditions + [self._ready_condition(ready)]}})

    def add_pod(self, name: str, *, namespace: str = "default", node_name: str | None = None,
                gpus: int = 0, phase: str = "Running", labels: Mapping[str, str] | None = None) -> Obj:
        """A Pod created by someone else (not the bridge), already in `phase`."""
        container: Obj = {"name": "main", "image": "busybox:latest"}
        if gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)},
                                      "requests": {"nvidia.com/gpu": str(gpus)}}
        spec: Obj = {"containers": [container], "restartPolicy": "Never"}
        status: Obj = {"phase": phase}
        if node_name:
            spec["nodeName"] = node_name
            status["conditions"] = _with_condition({}, {"type": "PodScheduled", "status": "True"})
        if phase != "Pending" or node_name:
            state, ready = _container_state(phase, None, None, None)
            status["containerStatuses"] = [self._container_status(container, state, ready)]
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": dict(labels or {})}, "spec": spec, "status": status}
        return self._locked(lambda: self._emulator.store_new(PODS, namespace, body))

    @staticmethod
    def _container_status(container: Obj, state: Obj, ready: bool) -> Obj:
        return {"name": container.get("name", "main"), "image": container.get("image", ""),
                "imageID": "", "containerID": "containerd://" + secrets.token_hex(8),
                "ready": ready, "started": "running" in state, "restartCount": 0, "state": state}

    def pods(self, namespace: str | None = None) -> list[Obj]:
        return [p for p in self.objects(PODS) if namespace is None or p["metadata"].get("namespace") == namespace]

    def pod(self, namespace: str, name: str) -> Obj | None:
        return self.get(PODS, namespace, name)

    def nodes(self) -> list[Obj]:
        return self.objects(NODES)

    def node(self, name: str) -> Obj | None:
        return self.get(NODES, None, name)

    def events(self, namespace: str | None = None) -> list[Obj]:
        return [e for e in self.objects(EVENTS) if namespace is None or e["metadata"].get("namespace") == namespace]

    def objects(self, resource: references.resource) -> list[Obj]:
        return self._locked(lambda: self._snapshot(resource))

    async def _snapshot(self, resource: references.resource) -> list[Obj]:
        return [copy.deepcopy(raw) for _, _, raw in self._emulator.live(resource)]

    def get(self, resource: references.resource, namespace: str | None, name: str) -> Obj | None:
        for obj in self.objects(resource):
            if obj["metadata"].get("namespace") == namespace and obj["metadata"]["name"] == name:
                return obj
        return None

    def patch(self, resource: references.resource, namespace: str | None, name: str, patch: Obj) -> Obj:
        """Merge-patch any object (kmock semantics: dicts merge, lists replace, None deletes)."""
        return self._locked(lambda: self._emulator.store_patch(resource, namespace, name, patch))

    def delete(self, resource: references.resource, namespace: str | None, name: str) -> None:
        """Delete at once (ignores finalizers), as after a forced delete."""
        self._locked(lambda: self._emulator.store_delete(resource, namespace, name))

    # -- scheduler and kubelet

    def bind(self, namespace: str, name: str, node_name: str) -> Obj:
        """kube-scheduler placed the pod: spec.nodeName plus PodScheduled=True."""
        pod = self._pod_or_fail(namespace, name)
        conditions = _with_condition(pod.get("status", {}), {"type": "PodScheduled", "status": "True"})
        return self.patch(PODS, namespace, name, {"spec": {"nodeName": node_name},
                                                  "status": {"conditions": conditions}})

    def unschedulable(self, namespace: str, name: str, message: str) -> Obj:
        """kube-scheduler gave up for now: PodScheduled=False/Unschedulable and a FailedScheduling Event."""
        pod = self._pod_or_fail(namespace, name)
        conditions = _with_condition(pod.get("status", {}), {
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message})
        patched = self.patch(PODS, namespace, name, {"status": {"conditions": conditions}})
        now = _now()
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{name}.{secrets.token_hex(8)}"},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": namespace,
                               "uid": pod["metadata"].get("uid"),
                               "resourceVersion": pod["metadata"].get("resourceVersion")},
            "reason": "FailedScheduling", "message": message, "type": "Warning",
            "source": {"component": "default-scheduler"}, "reportingComponent": "default-scheduler",
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        self._locked(lambda: self._emulator.store_new(EVENTS, namespace, event))
        return patched

    def set_phase(self, namespace: str, name: str, phase: str, *, exit_code: int | None = None,
                  reason: str | None = None, message: str | None = None) -> Obj:
        """kubelet reports: status.phase and containerStatuses[0].state (waiting/running/terminated)."""
        pod = self._pod_or_fail(namespace, name)
        containers = pod.get("spec", {}).get("containers") or [{"name": "main"}]
        state, ready = _container_state(phase, exit_code, reason, message)
        statuses = [self._container_status(containers[0], state, ready)]
        statuses += [self._container_status(c, state, ready) for c in containers[1:]]
        status: Obj = {"phase": phase, "containerStatuses": statuses}
        if phase in ("Running", "Succeeded", "Failed"):
            status.setdefault("startTime", pod.get("status", {}).get("startTime") or _now())
            status["conditions"] = _with_condition(pod.get("status", {}), {
                "type": "Ready", "status": "True" if ready else "False"})
        return self.patch(PODS, namespace, name, {"status": status})

    def set_log(self, namespace: str, name: str, text: str) -> None:
        self._emulator.logs[(namespace, name)] = text  # a dict assignment is atomic; no lock needed

    def forbid_cluster_pod_list(self, forbidden: bool = True) -> None:
        """RBAC with only a namespaced Role: GET /api/v1/pods (list or watch) answers 403."""
        self._emulator.forbid_all_namespaces_pods = forbidden

    def _pod_or_fail(self, namespace: str, name: str) -> Obj:
        pod = self.pod(namespace, name)
        if pod is None:
            raise KeyError(f"no pod {namespace}/{name} in the emulated cluster")
        return pod

    @property
    def request_count(self) -> int:
        """How many HTTP requests the server has answered (for "no extra traffic" checks)."""
        return len(self._emulator._requests)

    def stop(self) -> None:
        if not self._loop.is_running():
            return

        async def close() -> None:
            await self._emulator.shutdown_watches()
            await self._server.close()
            await self._emulator.__aexit__(None, None, None)  # stops kmock's background task
        try:
            self._call(close)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()


def write_kubeconfig(path: str | Path, clusters: Mapping[str, EmulatedCluster], *,
                     namespace: str = "default", current: str | None = None) -> Path:
    """A real kubeconfig (JSON is valid YAML) with one context per emulated cluster."""
    path = Path(path)
    config = {
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "current-context": current or next(iter(clusters)),
        "clusters": [{"name": ctx, "cluster": {"server": c.url}} for ctx, c in clusters.items()],
        "users": [{"name": f"{ctx}-user", "user": {"token": f"emulated-token-{ctx}"}} for ctx in clusters],
        "contexts": [{"name": ctx, "context": {"cluster": ctx, "user": f"{ctx}-user", "namespace": namespace}}
                     for ctx in clusters],
    }
    path.write_text(json.dumps(config, indent=2))
    return path
