"""A toy training loop that checkpoints through WhaleZen's helper (agent/checkpoint), stdlib only.

It fits y = 3x + 1 with plain SGD: the "model" is a dict of two floats, saved as JSON. At start
it restores the newest checkpoint that verifies (printing `restored from step N`, and with
--print-restore-seconds `restored from step N in X.XXX s`: the time from asking the helper for a
checkpoint to having the model back, which bench/migration.py reads from the job's log); it then
prints `step N loss X` every step, checkpoints every --checkpoint-every-seconds and whenever the
agent asks (SIGUSR1 or the request file), outside WhaleZen keeps the newest two checkpoints (under
WhaleZen the broker prunes), and exits 0 after --steps steps. --tear-checkpoint-at-step N is a
fault drill: in each run, the first checkpoint at or after step N gets one byte of its data
flipped after it is saved, as a crash or a bad disk can leave a write (the broker must never
commit or restore it). Each step's data comes from a generator seeded by the step number, so a run
that was stopped and restored computes the same numbers as one that never stopped.

Finding the helper: the script adds the folder above its own (the repository root) to the end
of sys.path, so `/usr/bin/python3 /path/to/whalezen/examples/train_toy.py` works from any working
directory as any user who can read the checkout. A copy moved elsewhere needs
`PYTHONPATH=/path/to/whalezen` (which also wins over the path it guesses).

Where checkpoints go: $WHALEZEN_CHECKPOINT_URI (set by the agent from the job's checkpoint.uri), or
--checkpoint-uri to try it by hand, e.g. `--checkpoint-uri /tmp/toy-ckpt`. s3:// needs boto3.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent
if (_REPO_ROOT / "agent" / "checkpoint" / "__init__.py").is_file():
    sys.path.append(str(_REPO_ROOT))

from agent import checkpoint  # noqa: E402  (needs the path above)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="stop after this step count (default 300)")
    parser.add_argument("--step-seconds", type=float, default=0.2, help="sleep per step (default 0.2)")
    parser.add_argument("--checkpoint-every-seconds", type=float, default=10.0,
                        help="checkpoint at least this often (default 10)")
    parser.add_argument("--checkpoint-uri", default=None, help="default: $WHALEZEN_CHECKPOINT_URI")
    parser.add_argument("--learning-rate", type=float, default=0.05)
    # Opt-in: the plain `restored from step N` line is what people and older tests look for verbatim.
    parser.add_argument("--print-restore-seconds", action="store_true",
                        help="say how long the restore took: `restored from step N in X.XXX s`")
    parser.add_argument("--tear-checkpoint-at-step", type=int, default=None, metavar="N",
                        help="fault drill: flip one byte of the first checkpoint saved at or after step N")
    return parser.parse_args(argv)


def tear(checkpoint_dir: str) -> None:
    """Flip the first byte of the checkpoint's data file, leaving its manifest as it was."""
    data = Path(checkpoint_dir) / "model.json"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))


def train_step(model: dict[str, float], step: int, learning_rate: float) -> float:
    """One SGD step on a small batch of y = 3x + 1 (+ noise); returns the batch's mean squared error."""
    rng = random.Random(step)
    batch = [(x, 3.0 * x + 1.0 + rng.gauss(0.0, 0.05)) for x in (rng.uniform(-1.0, 1.0) for _ in range(16))]
    grad_w = grad_b = loss = 0.0
    for x, y in batch:
        error = model["w"] * x + model["b"] - y
        loss += error * error
        grad_w += 2.0 * error * x
        grad_b += 2.0 * error
    model["w"] -= learning_rate * grad_w / len(batch)
    model["b"] -= learning_rate * grad_b / len(batch)
    return loss / len(batch)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    uri = args.checkpoint_uri or os.environ.get("WHALEZEN_CHECKPOINT_URI")
    ckpt = checkpoint.install(uri=uri, interval_seconds=args.checkpoint_every_seconds) if uri else None
    if ckpt is None:
        print("no checkpoint URI: training without checkpoints", flush=True)

    model = {"w": 0.0, "b": 0.0}
    start = 0
    # Timed from the helper's search for a checkpoint (listing, verifying against the manifest,
    # downloading for S3) to the model in memory: the restore part of a move's downtime.
    restore_started = time.monotonic()
    restored = ckpt.restore() if ckpt else None
    if restored is not None:
        with restored:  # an S3 restore downloaded into a temp folder; done with it after this
            model = json.loads(restored.read_bytes("model.json"))["model"]
        start = restored.step + 1
        took = f" in {time.monotonic() - restore_started:.3f} s" if args.print_restore_seconds else ""
        print(f"restored from step {restored.step}{took}", flush=True)

    for step in range(start, args.steps):
        loss = train_step(model, step, args.learning_rate)
        print(f"step {step} loss {loss:.6f}", flush=True)
        if ckpt is not None and (ckpt.due(step) or step == args.steps - 1):
            request = ckpt.requested()
            state = json.dumps({"model": model, "step": step}).encode()
            result = ckpt.save(step, {"model.json": state}, extra={"loss": loss})
            if args.tear_checkpoint_at_step is not None and step >= args.tear_checkpoint_at_step:
                args.tear_checkpoint_at_step = None
                tear(result.uri)
                print(f"checkpoint step {step} torn on purpose (--tear-checkpoint-at-step)", flush=True)
            ckpt.prune(keep=2)  # does nothing under WhaleZen: the broker prunes what it committed
            why = f"request {request.request_id}" if request and request.request_id else (
                "signal" if request else "interval or last step")
            print(f"checkpoint step {step} ({why}) -> {result.uri}", flush=True)
        time.sleep(args.step_seconds)
    print(f"done: w={model['w']:.4f} b={model['b']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
