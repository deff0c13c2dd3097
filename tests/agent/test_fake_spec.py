"""The --fake-gpus spec: node shapes, NVLink islands, options and clear errors."""
from __future__ import annotations

import pytest

from agent.backends.fake_models import GPU_MODELS, FakeSpecError, parse_spec


def test_eight_a100_sxm_form_one_island_on_two_numa_nodes():
    spec = parse_spec("8xA100-80GB-SXM")
    assert [m.key for m in spec.models] == ["A100-80GB-SXM"] * 8
    assert spec.islands == (0,) * 8
    assert spec.numa_nodes == 2
    assert spec.cpus == 256 and spec.memory_gb == 2048


def test_pcie_parts_have_no_nvlink_island():
    spec = parse_spec("4xT4")
    assert spec.islands == (None,) * 4
    assert spec.models[0].nvml_name == "Tesla T4"


def test_explicit_islands_split_the_board():
    assert parse_spec("8xH100-80GB-SXM,nvlink=2x4").islands == (0, 0, 0, 0, 1, 1, 1, 1)


def test_sixteen_sxm_gpus_are_two_boards_of_eight():
    assert parse_spec("16xH100").islands == (0,) * 8 + (1,) * 8


def test_mixed_node_keeps_pcie_gpus_out_of_islands():
    spec = parse_spec("4xH100-80GB-SXM+2xL4")
    assert spec.islands == (0, 0, 0, 0, None, None)
    assert [m.key for m in spec.models][-2:] == ["L4-24GB", "L4-24GB"]


def test_nvlink_none_and_single_gpu_island_is_none():
    assert parse_spec("2xA100,nvlink=none").islands == (None, None)
    assert parse_spec("1xH100").islands == (None,)


def test_options_parse():
    spec = parse_spec("2xA100-40GB-SXM,numa=1,cpus=24,memory_gb=64,mig=on,seed=7,xid=1:48,ecc=0:2,lost=1")
    assert (spec.numa_nodes, spec.cpus, spec.memory_gb, spec.mig, spec.seed) == (1, 24, 64, True, 7)
    assert spec.xids == ((1, 48),) and spec.ecc == ((0, 2),) and spec.lost == (1,)


def test_model_names_are_case_insensitive_and_aliased():
    assert parse_spec("2xh100").models[0].key == "H100-80GB-SXM"
    assert parse_spec("1xt4").models[0].key == "T4-16GB"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("8xB300", "unknown GPU model 'B300'"),
        ("eightxA100", "COUNTxMODEL"),
        ("0xT4", "COUNTxMODEL"),
        ("8xA100,nvlink=3x3", "AxB islands covering the 8"),
        ("4xT4,numa=9", "numa=9"),
        ("4xT4,xid=7:48", "out of range"),
        ("4xT4,xid=48", "GPU:NUMBER"),
        ("4xT4,colour=blue", "unknown option"),
        ("4xT4,seed=1,seed=2", "more than once"),
        ("4xT4,mig=maybe", "mig="),
        ("4xA100+4xH100,nvlink=1x8", "span two GPU models"),
    ],
)
def test_bad_specs_explain_themselves(text, fragment):
    with pytest.raises(FakeSpecError, match=None) as err:
        parse_spec(text)
    assert fragment in str(err.value)


def test_model_table_is_plausible():
    for model in GPU_MODELS.values():
        assert model.memory_mb > 10_000 and model.tdp_w >= 70
        assert (model.nvlink_links == 0) == (model.fabric == "none")
        assert model.fabric != "nvswitch" or model.nvswitches > 0
