"""FGD fragmentation measure on hand-computed examples."""

from __future__ import annotations

import numpy as np
import pytest

from scheduling.fragmentation import (
    TaskClass,
    Workload,
    fgd_score,
    fragmentation_batch,
    fragmentation_delta,
    node_fragmentation,
    normalise,
    workload_from_tasks,
)

HALF_ONE = normalise([TaskClass(1000, 1000, 1, 1.0), TaskClass(1000, 500, 1, 1.0)])


def test_small_gpu_is_fragment_for_both_classes() -> None:
    # 300 left is below both 1000 and 500: fragment for each class, 1000 is usable by both.
    assert node_fragmentation([1000, 300], 8000, HALF_ONE) == pytest.approx(300.0)


def test_gpu_between_class_sizes_counts_for_one_class_only() -> None:
    # 600 left: too small for the 1-GPU class (0.5 * 600), usable by the 0.5-GPU class.
    assert node_fragmentation([600], 8000, HALF_ONE) == pytest.approx(300.0)


def test_lack_of_cpu_makes_everything_a_fragment() -> None:
    assert node_fragmentation([1000, 1000], 500, HALF_ONE) == pytest.approx(2000.0)


def test_cpu_only_class_sees_all_gpus_as_fragment() -> None:
    wl = normalise([TaskClass(1000, 0, 0, 1.0), TaskClass(1000, 1000, 1, 3.0)])
    # CPU-only class (p=0.25) cannot use 2000 free milli; the 1-GPU class uses all of it.
    assert node_fragmentation([1000, 1000], 8000, wl) == pytest.approx(500.0)


def test_multi_gpu_class_needs_enough_gpus() -> None:
    wl = normalise([TaskClass(0, 1000, 2, 1.0)])
    assert node_fragmentation([1000, 1000, 1000], 0, wl) == pytest.approx(0.0)
    assert node_fragmentation([1000, 700, 0], 0, wl) == pytest.approx(1700.0)


def test_model_constraint_and_memory() -> None:
    wl = normalise([TaskClass(0, 1000, 1, 1.0, memory_mib=100, gpu_models=frozenset({"T4"}))])
    assert node_fragmentation([1000], 0, wl, mem_free=200, model="T4") == 0.0
    assert node_fragmentation([1000], 0, wl, mem_free=200, model="P100") == 1000.0
    assert node_fragmentation([1000], 0, wl, mem_free=50, model="T4") == 1000.0


def test_batch_matches_single_and_pads_with_zero() -> None:
    g = np.array([[1000, 300, 0, 0], [600, 0, 0, 0], [1000, 1000, 1000, 1000]])
    cpu = np.array([8000, 8000, 500])
    out = fragmentation_batch(g, cpu, HALF_ONE)
    assert out.tolist() == pytest.approx([300.0, 300.0, 4000.0])


def test_delta_and_score() -> None:
    # Placing a 0.5 task on the 600-GPU leaves 100: F goes 300 -> 100 (both classes), delta -200.
    d = fragmentation_delta([600], 8000, [500], 1000, HALF_ONE)
    assert d == pytest.approx(-200.0)
    assert fgd_score(0.0) == 50
    assert fgd_score(-200.0) == 54  # int(100 * sigmoid(0.2)) = int(54.98)
    assert fgd_score(1000.0) == 26  # int(100 * sigmoid(-1)) = int(26.89)
    with pytest.raises(ValueError):
        fragmentation_delta([400], 8000, [500], 0, HALF_ONE)


def test_workload_from_tasks_coverage_and_order() -> None:
    tasks = [(1000, 0, 1000, 1, None)] * 6 + [(2000, 0, 500, 1, None)] * 3 + [(4000, 0, 0, 0, None)]
    wl = workload_from_tasks(tasks, coverage=0.9)
    assert [(c.cpu_milli, round(c.weight, 4)) for c in wl.classes] == [(1000, 0.6667), (2000, 0.3333)]
    assert len(workload_from_tasks(tasks, coverage=1.0).classes) == 3


def test_weights_must_sum_to_one() -> None:
    with pytest.raises(ValueError):
        Workload((TaskClass(0, 1000, 1, 0.5),))


def test_lookahead_measure_equals_fgd_at_power_one_and_keeps_only_dust_when_long_sighted() -> None:
    from scheduling.fragmentation import lookahead_fragmentation_batch

    wl = normalise([TaskClass(1000, 1000, 1, 1.0), TaskClass(1000, 500, 1, 1.0), TaskClass(1000, 0, 0, 0.5)])
    g = np.array([[1000, 300], [600, 0], [1000, 1000]])
    cpu = np.array([8000, 8000, 500])
    fgd = fragmentation_batch(g, cpu, wl)
    assert lookahead_fragmentation_batch(g, cpu, wl, power=1.0).tolist() == pytest.approx(fgd.tolist())
    # q per GPU: a full GPU is usable by 0.8 of the mix, a 600 share by 0.4, 300 by nothing.
    # power 3: 1000 * 0.2^3 + 300 = 308;  600 * 0.6^3 = 129.6;  no CPU on node 3: all 2000 stay.
    out = lookahead_fragmentation_batch(g, cpu, wl, power=3.0)
    assert out.tolist() == pytest.approx([308.0, 129.6, 2000.0])
