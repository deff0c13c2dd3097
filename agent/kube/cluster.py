"""One Kubernetes cluster as the bridge uses it: the official client, plain JSON dicts in and out.

Every call has a client-side timeout (`_request_timeout`), so a hung API server never wedges the bridge.
Pods the bridge made are kept current by a watch (`PodWatch`): a list, then a watch from the list's
resourceVersion with `timeout_seconds`, started again when the server ends it or it fails, listing
afresh on 410 Gone. Events are applied by resourceVersion, so a duplicate or replayed event is harmless.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.kube.inventory import BROKER_LABEL

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 15.0
WATCH_SECONDS = 30  # the server ends each watch after this; the client gives it WATCH_SECONDS + 15


class KubeConfigError(ValueError):
    """The kubeconfig reference cannot be used (a usage error: the CLI exits 2 with this message)."""


@dataclass(frozen=True)
class ClusterConfig:
    kubeconfig: str  # a path, `env:NAME` (NAME holds the path, like KUBECONFIG) or `in-cluster`
    context: str | None
    namespace: str
    broker_id: str  # the value of the whalezen.io/broker label on every Pod this bridge makes


def kubeconfig_path(ref: str) -> str | None:
    """The kubeconfig file a reference names; None for `in-cluster`. Never logs the file's content."""
    if ref == "in-cluster":
        return None
    if ref.startswith("env:"):
        name = ref[4:]
        value = os.environ.get(name, "")
        if not value:
            raise KubeConfigError(f"--kubeconfig {ref}: the environment variable {name} is not set")
        ref = value.split(os.pathsep)[0]
    if not os.path.isfile(ref):
        raise KubeConfigError(f"--kubeconfig: no file at {ref}")
    return ref


def api_client(config: ClusterConfig) -> Any:
    from kubernetes import client, config as kube_config  # only the bridge needs the client library

    path = kubeconfig_path(config.kubeconfig)
    if path is None:
        kube_config.load_incluster_config()
        return client.ApiClient()
    try:
        return kube_config.new_client_from_config(config_file=path, context=config.context)
    except kube_config.ConfigException as err:
        raise KubeConfigError(f"--kubeconfig {config.kubeconfig}: {err}") from None


def _json(response: Any) -> dict[str, Any]:
    return json.loads(response.data or b"{}")


class Cluster:
    """The calls the bridge makes. Raises kubernetes.client.ApiException / urllib3 errors unchanged."""

    def __init__(self, config: ClusterConfig, client: Any | None = None) -> None:
        from kubernetes import client as kube_client

        self.config = config
        self.api_client = client or api_client(config)
        self.core = kube_client.CoreV1Api(self.api_client)
        self.pod_visibility = "all namespaces"  # or a sentence saying what cannot be seen (403)
        self.sees_all_pods = True

    @property
    def namespace(self) -> str:
        return self.config.namespace

    def list_nodes(self) -> list[dict[str, Any]]:
        return _json(self.core.list_node(_preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)).get("items") or []

    def list_pods_everywhere(self) -> list[dict[str, Any]]:
        """Every pod the bridge may see, for free-GPU counts. Without permission to list pods in all
        namespaces (403), the pool's own namespace only, and `pod_visibility` says so."""
        from kubernetes.client import ApiException

        try:
            body = _json(self.core.list_pod_for_all_namespaces(_preload_content=False,
                                                               _request_timeout=REQUEST_TIMEOUT_S))
            self.pod_visibility, self.sees_all_pods = "all namespaces", True
        except ApiException as err:
            if err.status != 403:
                raise
            if self.sees_all_pods:
                log.warning("listing pods in all namespaces is forbidden (403): GPUs that pods of other namespaces "
                            "hold are not counted as taken; grant list on pods cluster-wide to count them")
            self.sees_all_pods = False
            self.pod_visibility = (f"namespace {self.namespace} only: listing pods in all namespaces is forbidden "
                                   "(403), so GPUs that other namespaces' pods hold are not counted as taken")
            body = _json(self.core.list_namespaced_pod(self.namespace, _preload_content=False,
                                                       _request_timeout=REQUEST_TIMEOUT_S))
        return body.get("items") or []

    def create_pod(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        return _json(self.core.create_namespaced_pod(self.namespace, manifest, _preload_content=False,
                                                     _request_timeout=REQUEST_TIMEOUT_S))

    def read_pod(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client import ApiException

        try:
            return _json(self.core.read_namespaced_pod(name, self.namespace, _preload_content=False,
                                                       _request_timeout=REQUEST_TIMEOUT_S))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def create_secret(self, manifest: Mapping[str, Any]) -> None:
        self._create(self.core.create_namespaced_secret, manifest)

    def create_service(self, manifest: Mapping[str, Any]) -> None:
        """A gang's headless Service. One left by an earlier placement of the same job (its owner, that
        placement's rank 0 Pod, is gone, and the garbage collector deletes it in its own time) is taken over:
        it gets the new owner, or the collector would delete it under the running gang and its DNS names."""
        from kubernetes.client import ApiException

        metadata = manifest["metadata"]
        try:
            self.core.create_namespaced_service(self.namespace, manifest, _preload_content=False,
                                                _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as err:
            if err.status != 409:
                raise
            self.core.patch_namespaced_service(metadata["name"], self.namespace,
                                               {"metadata": {"ownerReferences": metadata["ownerReferences"]}},
                                               _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)

    def _create(self, create: Any, manifest: Mapping[str, Any]) -> None:
        from kubernetes.client import ApiException

        try:
            create(self.namespace, manifest, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as err:
            if err.status != 409:  # made by an earlier try of this same start
                raise

    def delete_pod(self, name: str, *, grace_seconds: int) -> bool:
        """Delete a Pod (its env Secret goes with it, as the Pod owns it). False when already gone."""
        from kubernetes.client import ApiException

        try:
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=grace_seconds,
                                            _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)
            return True
        except ApiException as err:
            if err.status == 404:
                return False
            raise

    def annotate_pod(self, name: str, annotations: Mapping[str, str]) -> None:
        self.core.patch_namespaced_pod(name, self.namespace, {"metadata": {"annotations": dict(annotations)}},
                                       _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)

    def pod_log_tail(self, name: str, *, lines: int | None = 50, limit_bytes: int = 4000) -> str:
        from kubernetes.client import ApiException

        kwargs: dict[str, Any] = {"tail_lines": lines} if lines else {}
        try:
            response = self.core.read_namespaced_pod_log(name, self.namespace, limit_bytes=limit_bytes,
                                                         _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S,
                                                         **kwargs)
        except ApiException:
            return ""  # the log is a courtesy: a pod that never started has none
        return (response.data or b"")[-limit_bytes:].decode("utf-8", errors="replace")

    def scheduling_failure(self, name: str) -> str:
        """The latest FailedScheduling event's message for a Pod, "" when there is none."""
        from kubernetes.client import ApiException

        try:
            body = _json(self.core.list_namespaced_event(
                self.namespace, field_selector=f"involvedObject.name={name}", _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S))
        except ApiException:
            return ""
        events = [e for e in body.get("items") or [] if e.get("reason") == "FailedScheduling"
                  and (e.get("involvedObject") or {}).get("name") == name]
        return str(events[-1].get("message") or "") if events else ""


class PodWatch:
    """The bridge's own Pods in its namespace, kept current by list + watch in a thread of its own."""

    def __init__(self, cluster: Cluster, *, watch_seconds: int = WATCH_SECONDS) -> None:
        self.cluster = cluster
        self.watch_seconds = watch_seconds
        self.selector = f"{BROKER_LABEL}={cluster.config.broker_id}"
        self._pods: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listed = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kube-pod-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def wait_listed(self, timeout: float) -> bool:
        return self._listed.wait(timeout)

    def get(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._pods.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._pods)

    def put(self, pod: Mapping[str, Any]) -> None:
        """What a create or read returned: seen at once, before the watch brings it."""
        self._apply("MODIFIED", pod)

    def _apply(self, kind: str, pod: Mapping[str, Any]) -> None:
        name = (pod.get("metadata") or {}).get("name")
        if not name:
            return
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(name, None)
                return
            known = self._pods.get(name)
            if known is not None and _version(known) > _version(pod):
                return  # an older state replayed after a newer one: keep the newer
            self._pods[name] = dict(pod)

    def relist(self) -> str:
        body = _json(self.cluster.core.list_namespaced_pod(
            self.cluster.namespace, label_selector=self.selector, _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT_S))
        items = {p["metadata"]["name"]: p for p in body.get("items") or [] if (p.get("metadata") or {}).get("name")}
        with self._lock:
            self._pods = items
        self._listed.set()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client import ApiException

        version = ""
        while not self._stop.is_set():
            try:
                if not version:
                    version = self.relist()
                stream = watch.Watch()
                # deserialize=False: plain JSON events. The client's models refuse objects they do not expect
                # (a field newer than the client, a value it thinks required), and one such Pod would end
                # every watch for good.
                kwargs: dict[str, Any] = {"label_selector": self.selector, "timeout_seconds": self.watch_seconds,
                                          "_request_timeout": self.watch_seconds + 15, "deserialize": False}
                if version and version != "...":
                    kwargs["resource_version"] = version
                began = time.monotonic()
                for event in stream.stream(self.cluster.core.list_namespaced_pod, self.cluster.namespace, **kwargs):
                    if self._stop.is_set():
                        stream.stop()
                        break
                    raw = event.get("object") if isinstance(event.get("object"), dict) else {}
                    if event.get("type") == "ERROR":
                        version = ""  # 410 Gone and its kin: list afresh
                        break
                    self._apply(str(event.get("type")), raw)
                    version = str((raw.get("metadata") or {}).get("resourceVersion") or version)
                if time.monotonic() - began < 1.0:
                    self._stop.wait(0.5)  # a server that ends watches at once must not get a busy loop
            except ApiException as err:
                self.errors += 1
                version = "" if err.status == 410 else version
                log.warning("pod watch: %s %s; watching again", err.status, err.reason)
                self._stop.wait(1.0)
            except Exception as err:  # a dropped connection, a timeout: the watch starts again
                self.errors += 1
                log.warning("pod watch ended (%s); watching again", err)
                self._stop.wait(1.0)


def _version(obj: Mapping[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:  # resourceVersion is opaque to clients; ours are integers, others compare as 0
        return 0
