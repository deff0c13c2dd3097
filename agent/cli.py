"""Command line: `python -m agent probe ...` and `python -m agent --server URL --join-token-file F ...`.

Exit codes: 0 clean stop, 1 unexpected error, 2 bad usage, 3 GPUs cannot be read (no driver),
4 the broker refused registration (bad join token).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from agent import AGENT_VERSION
from agent.backends import FakeSpecError, GpuBackendUnavailable, open_backend
from agent.gang import address_problem
from agent.host import hostname
from agent.jointoken import JoinTokenError, read_join_token, reexec_without_token
from agent.selffence import DEFAULT_FENCE_AFTER_S

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NO_GPU_BACKEND, EXIT_REGISTRATION_REFUSED = 0, 1, 2, 3, 4
PROG = "whalezen-agent"


def _probe_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} probe", description="Print this node's GPU inventory and one telemetry sample as JSON."
    )
    parser.add_argument("--fake-gpus", metavar="SPEC", help="simulate GPUs, e.g. 8xA100-80GB-SXM or 4xT4")
    parser.add_argument("--name", help="node name (salts fake GPU UUIDs)")
    return parser


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,  # jointoken.py finds --join-token by its full name
        description="WhaleZen node agent: registers this node's GPUs with the broker and runs assigned jobs. "
        "Use `probe` to only print the GPU inventory.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {AGENT_VERSION}")
    parser.add_argument("--server", required=True, metavar="URL", help="broker base URL, e.g. http://broker:8000")
    parser.add_argument(
        "--join-token",
        metavar="TOKEN",
        help="the pool's join token; `-` reads it from stdin (a literal value, or env WHALEZEN_JOIN_TOKEN, "
        "makes the agent re-execute itself without it); only needed until the node is registered",
    )
    parser.add_argument("--join-token-file", type=Path, metavar="PATH", help="read the join token from PATH")
    parser.add_argument("--delete-join-token-file", action="store_true",
                        help="delete the --join-token-file once the node is registered")
    parser.add_argument("--join-token-fd", type=int, help=argparse.SUPPRESS)  # the re-exec hand-over
    parser.add_argument("--job-user", default=os.environ.get("WHALEZEN_AGENT_JOB_USER"), metavar="USER",
                        help="run jobs as USER (env WHALEZEN_AGENT_JOB_USER; default for root: whalezen-job if "
                        "it exists, else nobody; `self`: as the agent's own user, which lets jobs read its secrets)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where job work dirs go (default: <state dir>-jobs; never inside the state dir)")
    parser.add_argument("--name", default=None, help="node name (default: host name)")
    parser.add_argument("--state-dir", type=Path, default=None, help="where the node token and job state live")
    parser.add_argument("--heartbeat-seconds", type=float, default=None, help="override the broker's interval")
    parser.add_argument("--fake-gpus", metavar="SPEC", help="simulate GPUs instead of reading NVML")
    parser.add_argument("--fake-faults", type=Path, metavar="FILE",
                        help="with --fake-gpus: apply lines `xid GPU CODE`, `ecc GPU N`, `lost GPU` added to FILE")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="node label (repeatable)")
    parser.add_argument("--stop-grace-seconds", type=float, default=10.0,
                        help="time a job gets between SIGTERM and SIGKILL")
    parser.add_argument("--fence-after-seconds", type=_seconds, metavar="N",
                        default=os.environ.get("WHALEZEN_AGENT_FENCE_AFTER_SECONDS", f"{DEFAULT_FENCE_AFTER_S:g}"),
                        help="stop every job when the broker has accepted no heartbeat for N seconds (env "
                        "WHALEZEN_AGENT_FENCE_AFTER_SECONDS, default %(default)s; 0: never). Must match the "
                        "broker's WHALEZEN_AGENT_FENCE_AFTER_SECONDS")
    parser.add_argument("--spot-notice", choices=("none", "aws", "gcp", "local"), default="none",
                        help="watch the instance metadata service for spot interruption notices and pass them "
                        "to the broker (default: none)")
    parser.add_argument("--metadata-url", metavar="URL", default=None,
                        help="the metadata service (default for aws http://169.254.169.254, for gcp "
                        "http://metadata.google.internal; required for local)")
    parser.add_argument("--metrics-listen", default=os.environ.get("WHALEZEN_AGENT_METRICS_LISTEN", "127.0.0.1:0"),
                        metavar="HOST:PORT",
                        help="serve the GPUs' readings for Prometheus under DCGM exporter names here (env "
                        "WHALEZEN_AGENT_METRICS_LISTEN; default 127.0.0.1:0, any free port on loopback; "
                        "0.0.0.0:9400 where Prometheus scrapes from elsewhere, dcgm-exporter's port; off: none)")
    parser.add_argument("--advertise-address", metavar="ADDR", default=None,
                        help="IP address or DNS name the other nodes of a multi-node job reach this node at "
                        "(MASTER_ADDR, WHALEZEN_NODE_IPS); default: the address the broker sees this agent's "
                        "registration come from")
    parser.add_argument("--container-runtime", metavar="auto|none|NAME[,NAME]",
                        default=os.environ.get("WHALEZEN_AGENT_CONTAINER_RUNTIMES", "auto"),
                        help="how jobs with an image run (env WHALEZEN_AGENT_CONTAINER_RUNTIMES): auto (default) "
                        "finds podman, docker, apptainer or singularity on PATH; none refuses image jobs; names "
                        "pin those, first preferred")
    parser.add_argument("--log-level", default=os.environ.get("WHALEZEN_AGENT_LOG_LEVEL", "INFO"))
    return parser


def _listen(text: str) -> tuple[str, int] | None:
    """--metrics-listen: `HOST:PORT` (port 0: any free one), or None for `off`."""
    if text.strip().lower() in ("off", "none", ""):
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdecimal() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--metrics-listen: expected HOST:PORT or off, got {text[:60]!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _seconds(text: str) -> float:
    """A duration in seconds: finite and not negative (argparse makes a refusal exit 2, a usage error)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds (0 or more), got {text[:40]!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["probe"]:
        return _probe(_probe_parser().parse_args(args[1:]))
    if args[:1] == ["run"]:
        args = args[1:]
    kubernetes = args[:1] == ["kubernetes"]  # the Kubernetes bridge (agent/kube/)
    if argv is None:  # a real agent process: drop the token from environ and cmdline (jointoken.py)
        try:
            reexec_without_token(args)
        except JoinTokenError as err:
            return _fail(str(err), EXIT_USAGE)
    if kubernetes:
        from agent.kube.cli import main as bridge_main  # needs the kubernetes client, which agents do not

        return bridge_main(args[1:])
    return _run(_run_parser().parse_args(args))


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def _probe(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        backend = open_backend(args.fake_gpus, node_name=args.name)
        backend.start()
    except FakeSpecError as err:
        return _fail(f"--fake-gpus: {err}", EXIT_USAGE)
    except GpuBackendUnavailable as err:
        return _fail(str(err), EXIT_NO_GPU_BACKEND)
    try:
        inventory = backend.inventory()
        sample = backend.sample()
    finally:
        backend.close()
    report = {"agent_version": AGENT_VERSION, "inventory": inventory.to_json(), "sample": [r.to_json() for r in sample]}
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    from agent.loop import Agent, AgentConfig, RegistrationRefused
    from agent.state import default_state_dir

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = args.name or hostname()
    labels: dict[str, str] = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            return _fail(f"--label {item!r}: expected KEY=VALUE", EXIT_USAGE)
        labels[key] = value
    if args.fake_faults and not args.fake_gpus:
        return _fail("--fake-faults needs --fake-gpus", EXIT_USAGE)
    if args.metadata_url and args.spot_notice == "none":
        return _fail("--metadata-url needs --spot-notice", EXIT_USAGE)
    if args.delete_join_token_file and not args.join_token_file:
        return _fail("--delete-join-token-file needs --join-token-file", EXIT_USAGE)
    if args.advertise_address is not None and (why := address_problem(args.advertise_address)):
        return _fail(f"--advertise-address {args.advertise_address[:80]!r} {why}", EXIT_USAGE)
    try:
        metrics_listen = _listen(args.metrics_listen)
    except ValueError as err:
        return _fail(str(err), EXIT_USAGE)
    try:
        join_token = read_join_token(value=args.join_token, path=args.join_token_file, fd=args.join_token_fd)
    except JoinTokenError as err:
        return _fail(str(err), EXIT_USAGE)
    try:
        backend = open_backend(args.fake_gpus, faults_file=args.fake_faults, node_name=name)
    except FakeSpecError as err:
        return _fail(f"--fake-gpus: {err}", EXIT_USAGE)
    config = AgentConfig(
        server_url=args.server,
        join_token=join_token,
        name=name,
        state_dir=args.state_dir or default_state_dir(name),
        heartbeat_seconds=args.heartbeat_seconds,
        stop_grace_s=args.stop_grace_seconds,
        labels=labels,
        job_user=args.job_user,
        work_dir=args.work_dir,
        join_token_file=args.join_token_file if args.delete_join_token_file else None,
        fence_after_s=args.fence_after_seconds,
        spot_notice=args.spot_notice,
        metadata_url=args.metadata_url,
        metrics_listen=metrics_listen,
        advertise_address=args.advertise_address,
        container_runtimes=args.container_runtime,
    )
    try:
        agent = Agent(config, backend)
    except ValueError as err:  # e.g. a server URL without http://, a job user that cannot be used
        return _fail(str(err), EXIT_USAGE)
    signal.signal(signal.SIGTERM, agent.request_stop)
    signal.signal(signal.SIGINT, agent.request_stop)
    try:
        return agent.run()
    except GpuBackendUnavailable as err:
        return _fail(str(err), EXIT_NO_GPU_BACKEND)
    except RegistrationRefused as err:
        return _fail(f"registration refused: {err}", EXIT_REGISTRATION_REFUSED)
