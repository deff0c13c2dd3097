"""Derived task lists (`bench.derive`, `bench.fragmentation --derive`) and the independent placement check."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from bench import fragmentation, placement_check
from bench.derive import derive
from bench.loaders import read_nodes, read_tasks
from scheduling.sim.cluster import NodeSpec, TaskSpec

NODES = [NodeSpec("a", 32000, 65536, 8, "G2"), NodeSpec("b", 32000, 65536, 2, "T4"),
         NodeSpec("c", 32000, 65536, 2, "T4"), NodeSpec("d", 32000, 65536, 1, "P100")]


def mixed(n: int = 60) -> list[TaskSpec]:
    """CPU-only, shares, whole GPUs, 2/4/8-GPU gangs; every seventh GPU task names a model."""
    out = []
    for i in range(n):
        num, milli = [(0, 0), (1, 300), (1, 500), (1, 1000), (2, 1000), (4, 1000), (8, 1000)][i % 7]
        models = frozenset({"T4"}) if num and i % 3 == 0 else None
        out.append(TaskSpec(f"t{i}", 1000 + 100 * i, 2048, num, milli, models))
    return out


def no_models(tasks: list[TaskSpec]) -> list[TaskSpec]:
    return [TaskSpec(t.name, t.cpu_milli, t.memory_mib, t.num_gpu, t.gpu_milli) for t in tasks]


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, 2])


def test_share_keeps_only_fractional_tasks() -> None:
    out = derive(mixed(), "share", NODES, rng(1))
    assert out and all(t.num_gpu == 1 and 0 < t.gpu_milli < 1000 for t in out)
    assert len(out) == sum(1 for t in mixed() if t.num_gpu == 1 and t.gpu_milli < 1000 and t.gpu_milli)


def test_multigpu_keeps_only_tasks_of_two_gpus_or_more() -> None:
    out = derive(mixed(), "multigpu", NODES, rng(1))
    assert out and all(t.num_gpu >= 2 for t in out)
    assert {t.num_gpu for t in out} == {2, 4, 8}


def test_constrained_keeps_the_tasks_that_name_a_model() -> None:
    out = derive(mixed(), "constrained", NODES, rng(1))
    assert out and all(t.gpu_models for t in out)
    assert [t.name for t in out] == [t.name for t in mixed() if t.gpu_models]


def test_constrained_ties_a_list_without_models_to_models_that_fit_deterministically() -> None:
    tasks = no_models(mixed(200))
    out = derive(tasks, "constrained", NODES, rng(5))
    assert len(out) == sum(1 for t in tasks if t.num_gpu)  # every GPU task, no CPU-only one
    largest = {"G2": 8, "T4": 2, "P100": 1}
    for t in out:
        assert t.gpu_models is not None and len(t.gpu_models) == 1
        assert largest[next(iter(t.gpu_models))] >= t.num_gpu  # a model with a node it fits on
    # 8-GPU and 4-GPU tasks can only go to G2; one-GPU tasks are spread (G2 has 8 of the 13 GPUs)
    assert all(t.gpu_models == {"G2"} for t in out if t.num_gpu > 2)
    assert len({next(iter(t.gpu_models or ())) for t in out if t.num_gpu == 1}) == 3
    assert derive(tasks, "constrained", NODES, rng(5)) == out  # same seed, same list
    assert derive(tasks, "constrained", NODES, rng(6)) != out


def test_unknown_or_empty_derivation_is_refused() -> None:
    with pytest.raises(ValueError):
        derive(mixed(), "everything", NODES, rng(1))
    with pytest.raises(ValueError):
        derive([t for t in mixed() if t.num_gpu < 2], "multigpu", NODES, rng(1))


def write_data(tmp: Path) -> tuple[Path, Path]:
    npath, ppath = tmp / "nodes.csv", tmp / "openb_pod_list_tiny.csv"
    with open(npath, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sn", "cpu_milli", "memory_mib", "gpu", "model"])
        for i in range(9):
            n = NODES[i % 3]
            w.writerow([f"node-{i}", n.cpu_milli, n.memory_mib, n.num_gpu, n.model])
    with open(ppath, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec"])
        for t in mixed(40):
            w.writerow([t.name, t.cpu_milli, t.memory_mib, t.num_gpu, t.gpu_milli, ""])
    return npath, ppath


@pytest.mark.parametrize("kind", ["share", "multigpu", "constrained"])
def test_fragmentation_runs_a_derived_list_and_its_placements_pass_the_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    npath, ppath = write_data(tmp_path)
    placements = tmp_path / "placements.csv"
    fragmentation.main(["--nodes", str(npath), "--pods", str(ppath), "--derive", kind, "--seeds", "2",
                        "--policies", "whalezen-online,fgd,bestfit", "--no-bound", "--json", "--curve",
                        "--placements-out", str(placements)])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["derive"] == kind
    online = result["policies"]["whalezen-online"]
    curve = {int(k): v for k, v in online["curve"].items()}
    assert curve and min(curve) >= 50 and max(curve) <= 130
    assert all(0 <= v <= k + 1 for k, v in curve.items())  # never more allocated than arrived
    fgd = {int(k): v for k, v in result["policies"]["fgd"]["curve"].items()}
    assert online["behind_fgd_at"] == [k for k in sorted(curve) if k in fgd and curve[k] < fgd[k]]
    assert "whalezen-online behind fgd at" in out
    # the derived tasks' names resolve in the checker, which re-derives the first seed's list
    assert placement_check.main(["--nodes", str(npath), "--pods", str(ppath), "--derive", kind,
                                 "--placements", str(placements)]) > 0


def test_placement_check_refuses_over_allocation_and_a_wrong_model(tmp_path: Path) -> None:
    nodes = NODES
    tasks = [TaskSpec("x", 1000, 1024, 1, 600, frozenset({"T4"})), TaskSpec("y", 1000, 1024, 1, 600)]
    assert placement_check.check(nodes, tasks, [{"name": "x", "node": "b", "gpus": "0"},
                                                {"name": "y", "node": "b", "gpus": "1"}]) == 2
    with pytest.raises(ValueError, match="over-allocated"):
        placement_check.check(nodes, tasks, [{"name": "x", "node": "b", "gpus": "0"},
                                             {"name": "y#clone1", "node": "b", "gpus": "0"}])
    with pytest.raises(ValueError, match="model"):
        placement_check.check(nodes, tasks, [{"name": "x", "node": "a", "gpus": "0"}])
    with pytest.raises(ValueError, match="twice"):
        placement_check.check(nodes, tasks, [{"name": "y", "node": "a", "gpus": "0"},
                                             {"name": "y", "node": "a", "gpus": "1"}])


def test_read_back_of_generated_files_is_consistent(tmp_path: Path) -> None:
    npath, ppath = write_data(tmp_path)
    assert len(read_nodes(npath)) == 9 and len(read_tasks(ppath)) == 40


@pytest.mark.parametrize("defrag", [["--no-broker-defrag"], []])
def test_engine_broker_placements_on_a_derived_list_pass_the_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], defrag: list[str]) -> None:
    # With moves (the default) the file holds where each task ended, after any move.
    npath, ppath = write_data(tmp_path)
    placements = tmp_path / "placements.csv"
    result = fragmentation.main(["--nodes", str(npath), "--pods", str(ppath), "--derive", "constrained", "--seeds",
                                 "1", "--policies", "whalezen-broker,fgd", "--broker-every", "5", "--no-bound",
                                 "--json", "--placements-out", str(placements), "--placements-policy",
                                 "whalezen-broker", *defrag])
    capsys.readouterr()
    assert result["broker_defrag"] is (not defrag) and result["policies"]["fgd"]["migrations"] == 0
    with open(placements, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["name"].split("#")[0].startswith("t") for r in rows)
    assert placement_check.main(["--nodes", str(npath), "--pods", str(ppath), "--derive", "constrained",
                                 "--placements", str(placements)]) == len(rows)


def test_check_placements_replays_every_seed_of_every_policy(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    npath, ppath = write_data(tmp_path)
    result = fragmentation.main(["--nodes", str(npath), "--pods", str(ppath), "--derive", "constrained",
                                 "--seeds", "3", "--policies", "whalezen-broker,fgd,whalezen-batch",
                                 "--broker-every", "5", "--no-bound", "--json", "--check-placements"])
    capsys.readouterr()
    pols = result["policies"]
    # whalezen-batch records no placements, so it is the one policy left unchecked
    assert "placements_checked" not in pols["whalezen-batch"]
    for name in ("whalezen-broker", "fgd"):
        checked = pols[name]["placements_checked"]
        # three seeds' end states, each with tasks placed, all accepted (a refusal stops the run)
        assert checked["seeds"] == 3 and checked["rows"] >= 3


@pytest.mark.parametrize("corrupt", ["twice", "allocation"])
def test_check_placements_stops_on_placements_that_do_not_hold_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, corrupt: str) -> None:
    from scheduling.sim import protocol

    real = protocol.run_online

    def broken(*args, **kwargs):
        run = real(*args, **kwargs)
        if corrupt == "twice":  # a task placed twice: the checker's own rule
            run.placements.append(run.placements[0])
        else:  # the run reports more allocated than its placements hold
            run.alloc_pct[-1] += 1.0
        return run

    monkeypatch.setattr(fragmentation, "run_online", broken)
    npath, ppath = write_data(tmp_path)
    with pytest.raises(SystemExit, match="placement check failed \\(seed 42\\)"):
        fragmentation.main(["--nodes", str(npath), "--pods", str(ppath), "--seeds", "1", "--policies", "fgd",
                            "--no-bound", "--check-placements"])


def test_whalezen_batch_placements_are_refused(tmp_path: Path) -> None:
    npath, ppath = write_data(tmp_path)
    with pytest.raises(SystemExit):
        fragmentation.main(["--nodes", str(npath), "--pods", str(ppath), "--seeds", "1", "--policies",
                            "whalezen-batch", "--placements-out", str(tmp_path / "p.csv"),
                            "--placements-policy", "whalezen-batch"])


def test_the_sweep_flags_reach_whalezen_online_and_only_sound_values_are_taken(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduling.sim import registry

    used: list[tuple[tuple[float, ...], float, float, int]] = []

    class Recording(registry.WhaleZenOnline):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            used.append((self.powers, self.home_weight, self.alpha, len(self.tasks or ())))

    monkeypatch.setattr(registry, "WhaleZenOnline", Recording)
    npath, ppath = write_data(tmp_path)
    tasks = len(read_tasks(str(ppath)))
    common = ["--nodes", str(npath), "--pods", str(ppath), "--seeds", "2", "--policies", "whalezen-online,fgd",
              "--no-bound", "--json"]
    fragmentation.main(common + ["--lookahead-power", "4", "--home-weight", "0.5", "--stranding-alpha", "3"])
    assert used == [((4.0,), 0.5, 3.0, tasks)] * 2  # one policy per seed, fgd untouched, the whole list given
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (last["lookahead_power"], last["home_weight"], last["stranding_alpha"]) == ([4.0], 0.5, 3.0)
    used.clear()
    fragmentation.main(common + ["--lookahead-power", "1,6"])
    assert used == [((1.0, 6.0), 1.0, 2.0, tasks)] * 2
    used.clear()
    fragmentation.main(common)
    assert used == [((2.0, 10.0), 1.0, 2.0, tasks)] * 2  # the policy's own
    for flag, bad in (("--lookahead-power", "0"), ("--lookahead-power", "-2"), ("--lookahead-power", "x"),
                      ("--lookahead-power", "2,"), ("--lookahead-power", "2,0"),
                      ("--home-weight", "-1"), ("--home-weight", "nan"), ("--home-weight", "inf"),
                      ("--stranding-alpha", "-0.5"), ("--stranding-alpha", "nan")):
        with pytest.raises(SystemExit):
            fragmentation.main(common + [flag, bad])
