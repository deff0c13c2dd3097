"""The pure parts of bench/migration.py: reading the toy's log, lost work, medians, the JSON shape.
No service is started here (the bench itself needs the whole service and about a minute per run)."""
from __future__ import annotations

import json
from pathlib import Path

from bench import migration

LOG = """restored from step 41 in 0.004 s
step 42 loss 0.012000
checkpoint step 42 (interval or last step) -> /ckpt/run/step-42
step 43 loss 0.011000
step 44 loss 0.010500
"""


def run(submit: float, downtime: float, phases: tuple[float, float, float, float | None], lost_steps: int) -> dict:
    checkpoint, fence, start, restore = phases
    return {"submit_to_running_s": submit, "migration_downtime_s": downtime,
            "phases": {"checkpoint": checkpoint, "fence": fence, "start": start, "restore": restore},
            "lost_work_s_after_agent_kill": round(lost_steps * 0.1, 3), "lost_work_steps": lost_steps}


def test_last_step_is_the_last_step_line_and_none_before_any():
    assert migration.last_step(LOG) == 44
    assert migration.last_step("restored from step 3 in 0.001 s\n") is None
    # a line cut off mid-write by SIGKILL does not count; "checkpoint step N" lines are not steps
    assert migration.last_step(LOG + "step 45 lo") == 44
    assert migration.last_step("checkpoint step 9 (signal) -> x\n") is None


def test_restored_reads_step_and_seconds_and_the_plain_line():
    assert migration.restored(LOG) == (41, 0.004)
    assert migration.restored("restored from step 222\nstep 223 loss 1.0\n") == (222, None)
    assert migration.restored("step 0 loss 4.1\n") is None
    assert migration.restored("  restored from step 5") is None  # only at the start of a line


def test_lost_work_counts_the_steps_after_the_restored_checkpoint():
    assert migration.lost_work(57, 50, 0.1) == (7, 0.7)
    assert migration.lost_work(50, 50, 0.1) == (0, 0.0)
    assert migration.lost_work(49, 50, 0.1) == (0, 0.0)  # never negative


def test_median_skips_missing_values():
    assert migration.median([3.0, 1.0, 2.0]) == 2.0
    assert migration.median([1.0, None, 4.0]) == 2.5
    assert migration.median([None]) is None


def test_summary_is_the_median_of_each_figure_in_the_promised_shape():
    runs = [run(6.1, 9.0, (2.0, 3.0, 4.0, 0.004), 7), run(5.0, 11.0, (2.5, 3.5, 5.0, 0.002), 12),
            run(7.3, 10.0, (1.5, 4.0, 4.5, None), 9)]
    entry = migration.summarize("postgresql", runs)
    assert entry["db"] == "postgresql"
    assert entry["submit_to_running_s"] == 6.1 and entry["migration_downtime_s"] == 10.0
    assert entry["phases"] == {"checkpoint": 2.0, "fence": 3.5, "start": 4.5, "restore": 0.003}
    assert entry["lost_work_s_after_agent_kill"] == 0.9 and entry["lost_work_steps"] == 9
    assert entry["runs_measured"] == 3
    line = json.dumps({"runs": [migration.summarize("sqlite", runs), entry]})
    parsed = json.loads(line)
    required = {"db", "submit_to_running_s", "migration_downtime_s", "phases", "lost_work_s_after_agent_kill"}
    assert all(required <= set(e) for e in parsed["runs"])
    assert all(set(e["phases"]) == {"checkpoint", "fence", "start", "restore"} for e in parsed["runs"])


def test_table_has_a_row_per_db():
    entries = [migration.summarize("sqlite", [run(6.0, 9.0, (2.0, 3.0, 4.0, 0.004), 7)])]
    lines = migration.table(entries).splitlines()
    assert len(lines) == 2 and lines[1].split()[0] == "sqlite" and "0.7 (7)" in lines[1]


def test_toy_spec_fills_the_placeholders_and_sets_the_bench_timings():
    template = (Path(migration.ROOT) / "examples" / "train_toy.yaml").read_text()
    spec = migration.toy_spec(template, checkpoint_uri="/tmp/ckpt-root/run1", run="run1")
    command = spec["command"]
    assert "@" not in json.dumps(spec)
    assert command[1] == str(migration.ROOT / "examples" / "train_toy.py")
    assert command[command.index("--step-seconds") + 1] == str(migration.STEP_SECONDS)
    assert command[command.index("--checkpoint-every-seconds") + 1] == str(migration.CHECKPOINT_EVERY_SECONDS)
    assert command[-1] == "--print-restore-seconds"
    assert spec["checkpoint"]["uri"] == "/tmp/ckpt-root/run1"


def test_new_log_on_finds_the_fresh_allocation_of_that_node(tmp_path):
    agents = tmp_path / "demo-agents" / "pool-1" / "agents"
    old = agents / "acme-a100-0-jobs" / "1" / "job.log"
    other = agents / "acme-a100-1-jobs" / "2" / "job.log"
    for path in (old, other):
        path.parent.mkdir(parents=True)
        path.write_text("step 0 loss 1.0\n")
    assert migration.new_log_on(tmp_path, "acme-a100-1", {old}) == other
    assert migration.new_log_on(tmp_path, "acme-a100-0", {old}) is None
