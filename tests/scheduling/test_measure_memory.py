"""The engine's fragmentation measure (`patterns.node_cost_batch`) counts a node's free memory as
whalezen-online's does: a task class whose memory the node can no longer give cannot use its free
GPUs, so they count as fragment. Without it the engine's measure saw those GPUs as usable, chose
shares' nodes and GPUs on a node state whalezen-online would not have, and trailed it on the share
list (bench/README.md section 1)."""

from __future__ import annotations

import numpy as np
import pytest

from scheduling import fragmentation as fgd
from scheduling.model import WorkloadClass
from scheduling.patterns import LOOKAHEAD_POWERS, node_cost_batch, to_workload

# Quarter shares asking 8 GiB of host memory each.
QUARTERS = (WorkloadClass(gpus=1, gpu_milli=250, weight=1.0, cpu_milli=1000, memory_mb=8192),)


def test_free_gpus_of_a_node_out_of_memory_are_fragment():
    workload = to_workload(QUARTERS)
    gpu = [[1000, 1000, 500, 0]]
    ample, short = node_cost_batch(gpu, [32000], ["T4"], workload, [65536]), \
        node_cost_batch(gpu, [32000], ["T4"], workload, [4096])
    assert ample[0] == pytest.approx(0.0)
    # 4 GiB left: no quarter starts there, so all 2.5 free GPUs are lost to the mix.
    assert short[0] == pytest.approx(2.5)


def test_the_measure_is_whalezen_onlines_on_cpu_and_memory():
    workload = to_workload(QUARTERS)
    gpu = np.array([[1000, 300, 100, 0], [750, 750, 1000, 1000], [1000, 1000, 1000, 1000]], dtype=np.int64)
    cpu = np.array([8000, 2000, 500], dtype=np.int64)
    mem = np.array([4096, 65536, 65536], dtype=np.int64)
    access = workload.model_access(["T4"] * 3)
    online = fgd.horizons_fragmentation_batch(gpu, cpu, workload, mem, access, LOOKAHEAD_POWERS) / 1000
    assert np.allclose(node_cost_batch(gpu, cpu, ["T4"] * 3, workload, mem), online)
