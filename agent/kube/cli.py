"""`python -m agent kubernetes ...`: run the Kubernetes bridge for one cluster (docs/kubernetes.md).

Exit codes as the agent's: 0 clean stop, 1 unexpected error, 2 bad usage (a kubeconfig that cannot be
used, a bad selector), 4 the broker refused the join token.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.jointoken import JoinTokenError, read_join_token

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REGISTRATION_REFUSED = 0, 1, 2, 4
PROG = "whalezen-agent kubernetes"
_BRIDGE_ID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Bridge one Kubernetes cluster into a WhaleZen pool: each GPU node becomes a node of the pool, "
        "and the jobs the broker places there run as Pods.")
    p.add_argument("--server", required=True, metavar="URL", help="broker base URL, e.g. http://broker:8000")
    p.add_argument("--join-token", metavar="TOKEN", help="the pool's join token; `-` reads it from stdin")
    p.add_argument("--join-token-file", type=Path, metavar="PATH", help="read the join token from PATH")
    p.add_argument("--join-token-fd", type=int, help=argparse.SUPPRESS)  # the re-exec hand-over
    p.add_argument("--kubeconfig", default=os.environ.get("WHALEZEN_KUBECONFIG", "env:KUBECONFIG"), metavar="REF",
                   help="the cluster's kubeconfig: a path, env:NAME (the variable NAME holds the path) or in-cluster "
                   "(the service account of the bridge's own Pod); default env:KUBECONFIG. Its content is never "
                   "logged or sent to the broker")
    p.add_argument("--context", default=None, help="the kubeconfig context (default: its current context)")
    p.add_argument("--namespace", default="default", help="where the jobs' Pods go (default: default)")
    p.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE",
                   help="only nodes with this label (repeatable)")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="a label every node of the cluster gets in the broker (repeatable), e.g. "
                   "fabric=infiniband when the GPU nodes share an InfiniBand fabric: multi-node jobs go only "
                   "to nodes on a fast fabric. A node's own whalezen.io/fabric label says it per node")
    p.add_argument("--toleration", action="append", default=[], metavar="JSON",
                   help='a toleration added to every Pod, as JSON: {"key": "dedicated", "operator": "Equal", '
                   '"value": "ml", "effect": "NoSchedule"} (repeatable; the nvidia.com/gpu one is always there)')
    p.add_argument("--default-image", default="python:3.11-slim",
                   help="the image of jobs that name none (a Pod needs one; default %(default)s)")
    p.add_argument("--bridge-id", default="whalezen", metavar="ID",
                   help="the value of the whalezen.io/broker label on this bridge's Pods; one bridge per cluster "
                   "and namespace uses one ID (default %(default)s)")
    p.add_argument("--name-prefix", default="", help="the pool's node names: PREFIX + the Kubernetes node name")
    p.add_argument("--prometheus-url", default=os.environ.get("WHALEZEN_PROMETHEUS_URL") or None, metavar="URL",
                   help="the site's Prometheus, which scrapes dcgm-exporter: the nodes' GPU readings and Xid health "
                   "come from its series (env WHALEZEN_PROMETHEUS_URL; default: none, GPUs report no readings)")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="node tokens and job records (default: ~/.local/state/whalezen-kube/<context>)")
    p.add_argument("--refresh-seconds", type=float, default=15.0, help="how often nodes and pods are listed again")
    p.add_argument("--heartbeat-seconds", type=float, default=None, help="override the broker's interval")
    p.add_argument("--stop-grace-seconds", type=float, default=30.0,
                   help="a stopped job's Pod gets this long between SIGTERM and SIGKILL")
    p.add_argument("--log-level", default=os.environ.get("WHALEZEN_AGENT_LOG_LEVEL", "INFO"))
    return p


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", flush=True, file=sys.stderr)
    return code


def _pairs(items: Sequence[str], option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{option} {item[:80]!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _tolerations(items: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for item in items:
        try:
            value = json.loads(item)
        except ValueError:
            value = None
        if not isinstance(value, dict) or not set(value) <= {"key", "operator", "value", "effect", "tolerationSeconds"}:
            raise ValueError(f"--toleration {item[:80]!r}: expected a JSON object with key, operator, value, effect")
        out.append(value)
    return out


def main(args: Sequence[str]) -> int:
    from agent.kube.bridge import Bridge, BridgeConfig
    from agent.kube.cluster import ClusterConfig, KubeConfigError, kubeconfig_path
    from agent.loop import RegistrationRefused

    opts = parser().parse_args(list(args))
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        selector = _pairs(opts.node_selector, "--node-selector")
        labels = _pairs(opts.label, "--label")
        tolerations = _tolerations(opts.toleration)
        join_token = read_join_token(value=opts.join_token, path=opts.join_token_file, fd=opts.join_token_fd)
        kubeconfig_path(opts.kubeconfig)
    except (ValueError, JoinTokenError, KubeConfigError) as err:
        return _fail(str(err), EXIT_USAGE)
    if not _BRIDGE_ID.fullmatch(opts.bridge_id):
        return _fail("--bridge-id must be a Kubernetes label value (letters, digits, '-', '_', '.'; 63 at most)",
                     EXIT_USAGE)
    cluster = ClusterConfig(kubeconfig=opts.kubeconfig, context=opts.context, namespace=opts.namespace,
                            broker_id=opts.bridge_id)
    state_dir = opts.state_dir or Path.home() / ".local" / "state" / "whalezen-kube" / (opts.context or "default")
    config = BridgeConfig(server_url=opts.server, join_token=join_token, cluster=cluster, state_dir=state_dir,
                          default_image=opts.default_image, node_selector=selector, labels=labels,
                          tolerations=tolerations,
                          refresh_seconds=opts.refresh_seconds, heartbeat_seconds=opts.heartbeat_seconds,
                          stop_grace_s=opts.stop_grace_seconds, name_prefix=opts.name_prefix,
                          prometheus_url=opts.prometheus_url)
    try:
        bridge = Bridge(config)
    except KubeConfigError as err:
        return _fail(str(err), EXIT_USAGE)
    signal.signal(signal.SIGTERM, bridge.request_stop)
    signal.signal(signal.SIGINT, bridge.request_stop)
    try:
        return bridge.run()
    except RegistrationRefused as err:
        return _fail(f"registration refused: {err}", EXIT_REGISTRATION_REFUSED)
