"""The node agent on a real NVIDIA GPU: NVML probe, registration, a GPU job, DCGM-named metrics.

CI has no GPU, so the agent's real NVML path (`agent/backends/nvml.py` on `pynvml`) is otherwise
only tested against a stand-in library. Run this on a GPU machine, from the repository root, with
a Python that has the agent's requirements (`agent/requirements.txt`; no Django needed):

    python3 -m bench.real_gpu [--job-seconds 20] [--idle-seconds 20] [--json]

It runs, in order, what an operator does with a new node:
1. `python -m agent probe`: the inventory and one sample, read through NVML.
2. `python -m agent run` against the in-test broker (tests/agent/fake_broker.py, standard library
   only): registration with the real inventory and the metrics endpoint it reports.
3. A scrape of that endpoint while idle, and the agent's idle CPU from /proc over `--idle-seconds`.
4. A job assigned to GPU 0 that multiplies matrices with PyTorch for `--job-seconds`, run by the
   agent as its job user; a scrape while it runs (utilisation, framebuffer and power must rise).
5. The agent stopped with SIGTERM.
`--fake-gpus SPEC` runs the same steps on simulated GPUs (to try the script without a GPU; the job
then needs no CUDA). The last line with --json is one JSON object with what each step saw.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from bench.migration import wait_for
from bench.procs import cpu_seconds
from tests.agent.fake_broker import FakeBroker

DCGM_PREFIX = "DCGM_FI_DEV_"

# The job: matrix products on the GPU the agent hands it (CUDA_VISIBLE_DEVICES), for a set time.
GPU_JOB = """
import os, sys, time
import torch
seconds = float(sys.argv[1])
print("CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"), flush=True)
print("device:", torch.cuda.get_device_name(0), "count:", torch.cuda.device_count(), flush=True)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
ballast = torch.empty(int(20e9), dtype=torch.uint8, device="cuda")  # 20 GB, for DCGM_FI_DEV_FB_USED
print("computing", flush=True)
done, started = 0, time.monotonic()
while time.monotonic() - started < seconds:
    for _ in range(50):
        a @ b
    torch.cuda.synchronize()
    done += 50
elapsed = time.monotonic() - started
print(f"products: {done}, TFLOP/s: {done * 2 * 8192**3 / elapsed / 1e12:.0f}", flush=True)
"""
CPU_JOB = "import os, sys, time; print('CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', '')); " \
          "print('computing', flush=True); time.sleep(float(sys.argv[1]))"


def scrape(url: str) -> tuple[dict[str, float], list[str]]:
    """The endpoint's DCGM series as `NAME{gpu="0"}` -> value, and its DCGM lines as served."""
    lines = [line for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines()
             if line.startswith(DCGM_PREFIX)]
    series = {}
    for line in lines:
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        gpu = name_labels.split('gpu="', 1)[1].split('"', 1)[0]
        series[f'{name}{{gpu="{gpu}"}}'] = float(value)
    return series, lines


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.real_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--job-seconds", type=float, default=20.0)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--fake-gpus", metavar="SPEC", help="simulated GPUs instead of NVML")
    parser.add_argument("--job-user", default=None, help="passed to the agent (default: its own default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    fake = ["--fake-gpus", args.fake_gpus] if args.fake_gpus else []
    result: dict[str, Any] = {}

    probe = subprocess.run([sys.executable, "-m", "agent", "probe", *fake], capture_output=True, text=True,
                           timeout=60)
    print("== agent probe (exit %d)" % probe.returncode, probe.stdout, probe.stderr, sep="\n", flush=True)
    result["probe_exit"] = probe.returncode
    report = json.loads(probe.stdout) if probe.returncode == 0 else {}
    result["gpus"] = [{key: gpu.get(key) for key in ("index", "name", "uuid", "memory_total_mb", "pci_bus_id", "mig_mode")}
                      for gpu in report.get("inventory", {}).get("gpus", [])]

    broker = FakeBroker()
    broker.state.heartbeat_seconds = 2
    work = Path(tempfile.mkdtemp(prefix="whalezen-real-gpu-"))
    os.chmod(work, 0o755)
    command = [sys.executable, "-m", "agent", "run", "--server", broker.url, "--join-token", "join-secret",
               "--name", "gpu-node", "--state-dir", str(work / "state"), "--work-dir", str(work / "jobs"),
               "--metrics-listen", "127.0.0.1:0", "--container-runtime", "none", *fake]
    if args.job_user:
        command += ["--job-user", args.job_user]
    agent_log = open(work / "agent.log", "w")
    agent = subprocess.Popen(command, stdout=agent_log, stderr=subprocess.STDOUT)
    try:
        registration = wait_for(lambda: broker.state.registrations[:1], 60, "the agent to register")[0]
        wait_for(lambda: len(broker.state.heartbeats) >= 1, 30, "a heartbeat")
        result["registered"] = {"gpus": len(registration.get("gpus", [])), "metrics_url": registration.get("metrics_url"),
                                "cpu_milli": registration.get("cpu_milli"), "memory_mb": registration.get("memory_mb")}
        print("== registration", json.dumps(result["registered"]), flush=True)
        metrics_url = registration["metrics_url"]
        result["idle_metrics"], lines = scrape(metrics_url)
        result["gpu0_series"] = [line for line in lines if 'gpu="0"' in line]
        print("== the exporter's lines for GPU 0", *result["gpu0_series"], sep="\n", flush=True)
        print("== idle scrape", json.dumps(result["idle_metrics"], indent=1), flush=True)

        samples = []
        for _ in range(max(1, int(args.idle_seconds // 5))):
            before, started = cpu_seconds(agent.pid), time.monotonic()
            time.sleep(5)
            samples.append(100 * (cpu_seconds(agent.pid) - before) / (time.monotonic() - started))
        result["idle_cpu_pct_median"] = round(statistics.median(samples), 3)
        result["idle_cpu_pct_windows"] = [round(s, 3) for s in samples]
        print("== idle agent CPU, % of a core per 5 s window:", result["idle_cpu_pct_windows"], flush=True)

        source = CPU_JOB if args.fake_gpus else GPU_JOB
        broker.state.assignments.append({
            "id": "a1", "job_id": "j1", "epoch": 1, "action": "start", "gpu_indices": [0],
            "command": [sys.executable, "-c", source, str(args.job_seconds)], "env": {}})
        started = wait_for(lambda: [s["state"] for s in broker.statuses_for("a1") if s["state"] in ("running", "failed")],
                           60, "the job to run or fail")
        if started[0] == "running":
            # Scrape once the job computes (importing PyTorch and starting CUDA take seconds), after the
            # agent's next sample (every heartbeat, 2 s here).
            wait_for(lambda: "computing" in _job_log(work / "jobs") or broker.statuses_for("a1")[-1]["state"] != "running",
                     60, "the job to start computing")
            time.sleep(min(3.0, args.job_seconds / 3))
            result["busy_metrics"], _ = scrape(metrics_url)
            print("== scrape while the job runs", json.dumps(result["busy_metrics"], indent=1), flush=True)
        final = wait_for(lambda: [s for s in broker.statuses_for("a1") if s["state"] in ("exited", "failed")],
                         args.job_seconds + 90, "the job to finish")[0]
        result["job"] = {"states": [s["state"] for s in broker.statuses_for("a1")], "exit_code": final.get("exit_code"),
                         "message": final.get("message"), "job_log": _job_log(work / "jobs")}
        print("== job", json.dumps(result["job"], indent=1), flush=True)
        result["heartbeats"] = len(broker.state.heartbeats)
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            result["agent_exit"] = agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            result["agent_exit"] = "killed after 30 s"
        broker.stop()
        agent_log.close()
        print("== agent log (last 40 lines)", *open(work / "agent.log").read().splitlines()[-40:], sep="\n", flush=True)
    if args.json:
        print(json.dumps(result))
    if result.get("job", {}).get("exit_code") != 0:
        raise SystemExit(1)
    return result


def _job_log(jobs_dir: Path) -> list[str]:
    return [line for path in sorted(jobs_dir.glob("*/job.log")) for line in path.read_text().splitlines()]


if __name__ == "__main__":
    main()
