"""A Kubernetes cluster on a laptop, for the `make run` demo: the emulated API server plus a simulated
kube-scheduler and kubelet. `python -m providers.local.kube_sim --kubeconfig-out PATH --node NAME=4xPRODUCT`.

What it simulates, and how far:
- nodes with NVIDIA's labels and `nvidia.com/gpu` allocatable (`--node`), and other teams' pods holding GPUs
  (`--foreign-pod NAME=NODE:GPUS`);
- the scheduler: a Pending Pod is bound to a node its required node affinity allows (hostname and GPU product)
  that has the GPUs free, else marked Unschedulable with a FailedScheduling event, as kube-scheduler does;
- the kubelet: a bound Pod's container command runs as a local process (the image is not pulled: this is a
  simulator, like the demo's fake GPUs), with the env its Secret holds, its output as the Pod's log, the
  checkpoint-request annotation as its request file, and its exit code and termination message on exit;
  a deleted Pod's process gets SIGTERM, then SIGKILL after its grace period.
The processes run as the user who runs `make run`; nothing here is for a real cluster.
"""
from __future__ import annotations

import argparse
import base64
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from providers.local.kube_emulator import PODS, EmulatedCluster, references

log = logging.getLogger(__name__)

SECRETS = references.resource(group="", version="v1", plural="secrets")
GPU = "nvidia.com/gpu"
LOG_BYTES = 64 * 1024
SECRET_WAIT_S = 20.0  # the bridge creates the env Secret just after the Pod


@dataclass
class _Process:
    popen: subprocess.Popen[bytes]
    workdir: Path
    request: str = ""
    kill_at: float | None = None


def _gpus(pod: Mapping[str, Any]) -> int:
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        limits = (container.get("resources") or {}).get("limits") or {}
        try:
            total += int(str(limits.get(GPU, "0")))
        except ValueError:
            pass
    return total


def _key(pod: Mapping[str, Any]) -> tuple[str, str]:
    return pod["metadata"].get("namespace") or "", pod["metadata"]["name"]


class SimulatedKubelet:
    """kube-scheduler and every node's kubelet, one loop over the emulator's objects."""

    def __init__(self, cluster: EmulatedCluster, work_root: Path, *, grace_s: float = 5.0) -> None:
        self.cluster = cluster
        self.work_root = work_root
        self.grace_s = grace_s
        self.processes: dict[tuple[str, str], _Process] = {}
        self._waiting_since: dict[tuple[str, str], float] = {}

    def step(self) -> None:
        pods = self.cluster.objects(PODS)
        live = {_key(p): p for p in pods}
        for key in list(self.processes):
            if key not in live:
                self._stop(key)
        self._reap_stopped()
        nodes = {n["metadata"]["name"]: n for n in self.cluster.nodes()}
        used: dict[str, int] = {}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            if node and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                used[node] = used.get(node, 0) + _gpus(pod)
        for pod in pods:
            key, phase = _key(pod), (pod.get("status") or {}).get("phase")
            bound = (pod.get("spec") or {}).get("nodeName")
            if not bound and phase == "Pending":
                self._schedule(pod, nodes, used)
            elif bound and phase == "Pending" and key not in self.processes:
                self._start(pod)
            elif key in self.processes:
                self._follow(pod)

    # -- the scheduler ---------------------------------------------------------------------------
    def _schedule(self, pod: Mapping[str, Any], nodes: Mapping[str, Any], used: dict[str, int]) -> None:
        terms = (((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms") or [{}]
        wanted = _gpus(pod)
        no_match = short = 0
        for name, node in nodes.items():
            labels = node["metadata"].get("labels") or {}
            if not any(all(labels.get(e["key"]) in e.get("values", []) for e in term.get("matchExpressions") or [])
                       for term in terms):
                no_match += 1
                continue
            allocatable = int(str((node.get("status") or {}).get("allocatable", {}).get(GPU, "0")))
            if allocatable - used.get(name, 0) < wanted:
                short += 1
                continue
            self.cluster.bind(*_key(pod), name)
            used[name] = used.get(name, 0) + wanted
            return
        conditions = (pod.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "PodScheduled" and c.get("status") == "False" for c in conditions):
            return  # said once already
        parts = [f"{short} Insufficient {GPU}"] if short else []
        parts += [f"{no_match} node(s) didn't match Pod's node affinity/selector"] if no_match else []
        self.cluster.unschedulable(*_key(pod), f"0/{len(nodes)} nodes are available: {', '.join(parts)}.")

    # -- the kubelet -----------------------------------------------------------------------------
    def _start(self, pod: Mapping[str, Any]) -> None:
        key = _key(pod)
        container = ((pod.get("spec") or {}).get("containers") or [{}])[0]
        argv = [*(container.get("command") or []), *(container.get("args") or [])]
        env = self._secret_env(pod, container)
        if env is None:
            since = self._waiting_since.setdefault(key, time.monotonic())
            if time.monotonic() - since > SECRET_WAIT_S:
                self.cluster.set_phase(*key, "Failed", exit_code=1, reason="CreateContainerConfigError",
                                       message="its env Secret does not exist")
            return
        if not argv:
            self.cluster.set_phase(*key, "Failed", exit_code=127, reason="Error",
                                   message="the demo cluster runs a container's command on this machine, and this "
                                           "container has none (only its image's entrypoint)")
            return
        workdir = self.work_root / key[0] / key[1]
        (workdir / "work").mkdir(parents=True, exist_ok=True)
        env.update({"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir),
                    "WHALEZEN_WORK_DIR": str(workdir / "work"),
                    "WHALEZEN_CHECKPOINT_REQUEST_FILE": str(workdir / "checkpoint-request.json"),
                    "NVIDIA_VISIBLE_DEVICES": ",".join(str(i) for i in range(_gpus(pod)))})
        with (workdir / "output.log").open("ab") as output:
            popen = subprocess.Popen(argv, cwd=workdir, env=env, stdout=output, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes[key] = _Process(popen, workdir)
        self._waiting_since.pop(key, None)
        self.cluster.set_phase(*key, "Running")
        log.info("pod %s/%s: started %s (pid %d)", *key, argv[0], popen.pid)

    def _secret_env(self, pod: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, str] | None:
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            name = (source.get("secretRef") or {}).get("name")
            secret = self.cluster.get(SECRETS, _key(pod)[0], name) if name else None
            if secret is None:
                return None
            env.update({k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()})
        env.update({e["name"]: str(e.get("value", "")) for e in container.get("env") or [] if "name" in e})
        return env

    def _follow(self, pod: Mapping[str, Any]) -> None:
        key, process = _key(pod), self.processes[_key(pod)]
        request = ((pod.get("metadata") or {}).get("annotations") or {}).get("whalezen.io/checkpoint-request", "")
        if request and request != process.request:  # the downward API's file, refreshed
            (process.workdir / "checkpoint-request.json").write_text(request)
            process.request = request
        self._publish_log(key, process)
        code = process.popen.poll()
        if code is None:
            return
        del self.processes[key]
        self._publish_log(key, process)
        container = ((pod.get("spec") or {}).get("containers") or [{}])[0]
        message = ""
        path = container.get("terminationMessagePath")
        if path:
            notice = process.workdir / "work" / Path(path).name
            message = notice.read_text()[:4096] if notice.is_file() else ""
        exit_code = code if code >= 0 else 128 - code
        self.cluster.set_phase(*key, "Succeeded" if code == 0 else "Failed", exit_code=exit_code,
                               reason="Completed" if code == 0 else "Error", message=message or None)
        log.info("pod %s/%s: exited with code %d", *key, exit_code)

    def _publish_log(self, key: tuple[str, str], process: _Process) -> None:
        path = process.workdir / "output.log"
        try:
            with path.open("rb") as handle:
                handle.seek(max(0, path.stat().st_size - LOG_BYTES))
                self.cluster.set_log(*key, handle.read().decode("utf-8", errors="replace"))
        except OSError:
            pass

    def _stop(self, key: tuple[str, str]) -> None:
        process = self.processes[key]
        if process.kill_at is None:
            _signal(process.popen, signal.SIGTERM)
            process.kill_at = time.monotonic() + self.grace_s
            log.info("pod %s/%s deleted: its process is stopped", *key)

    def _reap_stopped(self) -> None:
        for key, process in list(self.processes.items()):
            if process.kill_at is None:
                continue
            if process.popen.poll() is not None:
                del self.processes[key]
            elif time.monotonic() >= process.kill_at:
                _signal(process.popen, signal.SIGKILL)

    def stop_all(self) -> None:
        for key in list(self.processes):
            self._stop(key)
        deadline = time.monotonic() + self.grace_s
        while self.processes and time.monotonic() < deadline + 1:
            self._reap_stopped()
            if time.monotonic() >= deadline:
                for process in self.processes.values():
                    _signal(process.popen, signal.SIGKILL)
            time.sleep(0.1)


def _signal(popen: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _node(text: str) -> tuple[str, int, str]:
    name, sep, spec = text.partition("=")
    count, x, product = spec.partition("x")
    if not sep or not x or not count.isdecimal():
        raise argparse.ArgumentTypeError(f"--node {text!r}: expected NAME=COUNTxPRODUCT, e.g. k8s-0=4xNVIDIA-L4")
    return name, int(count), product


def _foreign(text: str) -> tuple[str, str, int]:
    name, sep, rest = text.partition("=")
    node, colon, gpus = rest.partition(":")
    if not sep or not colon or not gpus.isdecimal():
        raise argparse.ArgumentTypeError(f"--foreign-pod {text!r}: expected NAME=NODE:GPUS")
    return name, node, int(gpus)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m providers.local.kube_sim", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig-out", type=Path, required=True, help="where the cluster's kubeconfig goes")
    parser.add_argument("--context", default="demo")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--node", type=_node, action="append", default=[], help="NAME=COUNTxPRODUCT (repeatable)")
    parser.add_argument("--foreign-pod", type=_foreign, action="append", default=[],
                        help="NAME=NODE:GPUS: a pod of another team's, holding GPUs (repeatable)")
    parser.add_argument("--work-dir", type=Path, required=True, help="where the Pods' processes run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cluster = EmulatedCluster()
    memory = {"NVIDIA-H100-80GB-HBM3": 81559, "NVIDIA-L4": 23034, "NVIDIA-A100-SXM4-80GB": 81920}
    for name, count, product in args.node:
        cluster.add_node(name, gpus=count, product=product, memory_mib=memory.get(product, 16384))
    for name, node, gpus in args.foreign_pod:
        cluster.add_pod(name, namespace="research", node_name=node, gpus=gpus)
    args.kubeconfig_out.parent.mkdir(parents=True, exist_ok=True)
    written = cluster.write_kubeconfig(args.kubeconfig_out.with_suffix(".tmp"), context=args.context,
                                       namespace=args.namespace)
    os.replace(written, args.kubeconfig_out)  # whole or nothing: the bridge may be reading it
    kubelet = SimulatedKubelet(cluster, args.work_dir)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    log.info("demo Kubernetes cluster at %s (%d nodes); kubeconfig %s", cluster.url, len(args.node),
             args.kubeconfig_out)
    try:
        while not stopping.is_set():
            try:
                kubelet.step()
            except Exception:  # one bad object must not stop the simulated cluster
                log.exception("simulated kubelet step failed")
            stopping.wait(0.3)
    finally:
        kubelet.stop_all()
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
