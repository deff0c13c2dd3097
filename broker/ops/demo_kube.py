"""The `make run` demo's Kubernetes cluster (opt-in: WHALEZEN_DEMO_KUBERNETES=1 make run).

`seed_demo` records a kubernetes pool whose `provider_config["demo_cluster"]` describes a simulated cluster
(nodes and other teams' pods); `serve` then supervises two processes per such pool, as it does web and worker:
the simulated cluster (providers/local/kube_sim.py: an emulated API server with a simulated scheduler and
kubelet) and the real bridge (`python -m agent kubernetes`) that registers its nodes with the broker.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

from django.conf import settings

from broker.inventory.models import Pool, PoolKind
from broker.inventory.services import pool_join_token_issue

DEMO_CLUSTER_KEY = "demo_cluster"
DEMO_NAMESPACE = "whalezen-jobs"


def demo_cluster_config(*, pool_name: str) -> dict[str, Any]:
    """The provider_config of the demo's kubernetes pool (seed_demo): where the bridge finds the kubeconfig
    the simulated cluster writes, and what that cluster holds."""
    folder = Path(settings.VAR_DIR).resolve() / "kube-demo" / pool_name
    return {"kubeconfig": str(folder / "kubeconfig"), "context": "demo", "namespace": DEMO_NAMESPACE,
            "node_selector": {}, "tolerations": [], "default_image": "python:3.11-slim",
            DEMO_CLUSTER_KEY: {"nodes": {"k8s-h100-0": "4xNVIDIA-H100-80GB-HBM3", "k8s-l4-0": "2xNVIDIA-L4"},
                               "foreign_pods": {"research-notebook": "k8s-h100-0:1"}}}


class DemoChild(NamedTuple):
    """A process `serve` supervises for the demo cluster."""

    name: str
    argv: list[str]
    after_file: Path | None = None  # started once this exists (the bridge: the kubeconfig the cluster writes)


def demo_kube_children(*, server_url: str, python: str = sys.executable) -> list[DemoChild]:
    """The simulated cluster and the bridge for every demo kubernetes pool. Issues each pool's join token
    into a 0600 file the bridge reads, and removes a kubeconfig an earlier run left (it names that run's
    port): the bridge starts once this run's cluster has written its own."""
    children = []
    for pool in Pool.objects.filter(kind=PoolKind.KUBERNETES, enabled=True).order_by("pk"):
        config = pool.provider_config or {}
        demo = config.get(DEMO_CLUSTER_KEY)
        if not isinstance(demo, dict) or not config.get("kubeconfig"):
            continue
        kubeconfig = Path(config["kubeconfig"])
        folder = kubeconfig.parent
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        kubeconfig.unlink(missing_ok=True)
        token_file = folder / "join-token"
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(pool_join_token_issue(pool=pool) + "\n")
        cluster = [python, "-m", "providers.local.kube_sim", "--kubeconfig-out", str(kubeconfig),
                   "--context", str(config.get("context") or "demo"), "--namespace", str(config["namespace"]),
                   "--work-dir", str(folder / "pods")]
        for name, spec in (demo.get("nodes") or {}).items():
            cluster += ["--node", f"{name}={spec}"]
        for name, spec in (demo.get("foreign_pods") or {}).items():
            cluster += ["--foreign-pod", f"{name}={spec}"]
        bridge = [python, "-m", "agent", "kubernetes", "--server", server_url, "--join-token-file", str(token_file),
                  "--kubeconfig", str(kubeconfig), "--context", str(config.get("context") or "demo"),
                  "--namespace", str(config["namespace"]), "--bridge-id", f"demo-{pool.pk}",
                  "--state-dir", str(folder / "bridge"), "--default-image", str(config.get("default_image")),
                  "--refresh-seconds", "5", "--stop-grace-seconds", "5"]
        children += [DemoChild(f"kube-cluster-{pool.pk}", cluster),
                     DemoChild(f"kube-bridge-{pool.pk}", bridge, after_file=kubeconfig)]
    return children
