"""The bridge's Pod watch (agent/kube/cluster.py PodWatch) against the emulated API server: it outlives the
server ending each watch, sees every change of its own Pods, and ignores a replayed older state."""
from __future__ import annotations

import time

from agent.kube.cluster import Cluster, ClusterConfig, PodWatch


def eventually(check, *, what: str, limit_s: float = 10.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def pod(name: str, broker: str = "wz") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml", "labels": {"whalezen.io/broker": broker}},
            "spec": {"containers": [{"name": "job", "image": "busybox"}]}}


def test_the_watch_is_restarted_when_the_server_ends_it_and_keeps_only_newer_states(emulated_cluster, tmp_path):
    kubeconfig = emulated_cluster.write_kubeconfig(tmp_path / "kubeconfig", namespace="ml")
    cluster = Cluster(ClusterConfig(kubeconfig=str(kubeconfig), context="emulated", namespace="ml", broker_id="wz"))
    watch = PodWatch(cluster, watch_seconds=1)  # the server ends each watch after 1 s
    watch.start()
    try:
        assert watch.wait_listed(5)
        cluster.create_pod(pod("a"))
        cluster.create_pod(pod("someone-else", broker="other"))
        eventually(lambda: watch.get("a"), what="the new Pod")
        time.sleep(2.5)  # two watches have ended by now
        emulated_cluster.bind("ml", "a", "n1")
        emulated_cluster.set_phase("ml", "a", "Running")
        eventually(lambda: (watch.get("a") or {}).get("status", {}).get("phase") == "Running",
                   what="a change made after the first watches ended")
        assert watch.get("someone-else") is None  # another broker's Pod is not ours to follow

        newer = watch.get("a")
        stale = {**newer, "metadata": {**newer["metadata"], "resourceVersion": "1"}, "status": {"phase": "Pending"}}
        watch.put(stale)  # a replayed older state (a slow read returning after the watch moved on)
        assert watch.get("a")["status"]["phase"] == "Running"

        cluster.delete_pod("a", grace_seconds=0)
        eventually(lambda: watch.get("a") is None, what="the deletion")
    finally:
        watch.stop()
