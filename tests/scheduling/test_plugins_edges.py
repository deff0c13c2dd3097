"""Filter plugins at their edges: the words of a pending reason and the limits a job may just reach (issue 9).

Each test is a scenario a user can meet: what the pending message says, or that a job that fits
exactly (price, quota, budget, launch quota) is placed and one a little over is not.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine_factories import FAST, budget, gpu_node, job, offer, snapshot
from scheduling.engine import schedule
from scheduling.model import OwnerBudget, QuotaShare, ReasonCode
from scheduling.plugins import resolve_filters, resolve_scores


def reason_of(snap, job_id="j", policy=FAST):
    plan = schedule(snap, policy)
    assert job_id not in {p.job_id for p in plan.placements}
    return plan.pending[job_id]


def busy(*positions: int, milli: int = 1000) -> dict[int, int]:
    return {p: milli for p in positions}


# -- how many GPUs a job lacks, in its own terms ---------------------------------------------------
def test_a_fractional_job_is_told_the_share_it_needs():
    node = gpu_node("n", used=busy(*range(8), milli=600))
    reason = reason_of(snapshot([node], [job("j", gpu_milli=500)]))
    assert reason.code == ReasonCode.INSUFFICIENT_GPUS
    assert reason.message == "INSUFFICIENT_GPUS: 0/1 nodes fit: 1 have no GPU with 0.5 of a GPU free; no cloud offers"


def test_a_job_with_alternatives_is_told_each_alternatives_count():
    node = gpu_node("n", used=busy(*range(6)))
    pending = [job("j", gpus=2, gpus_by_model=(("A100", 4), ("H100", 2)))]
    reason = reason_of(snapshot([node], pending))
    assert reason.message == ("INSUFFICIENT_GPUS: 0/1 nodes fit: 1 have fewer free GPUs per node than any "
                              "alternative needs (A100:4, H100:2); no cloud offers")


def test_a_compute_unit_job_is_told_the_compute_units_it_needs():
    node = gpu_node("n", used=busy(*range(6)))
    reason = reason_of(snapshot([node], [job("j", compute_units=4.0)]))
    assert reason.message == ("INSUFFICIENT_GPUS: 0/1 nodes fit: 1 have fewer than 4 CU of free GPUs per "
                              "node; no cloud offers")


def test_a_multi_node_job_is_told_the_gpus_it_needs_on_each_node():
    nodes = [gpu_node(f"n{i}", fast_fabric=True, used=busy(0, 1)) for i in range(2)]
    reason = reason_of(snapshot(nodes, [job("j", gpus=16, nodes=2)]))
    assert reason.message == "INSUFFICIENT_GPUS: 0/2 nodes fit: 2 have fewer than 8 free GPUs per node; no cloud offers"


# -- limits a job may reach exactly ----------------------------------------------------------------
def test_an_offer_at_exactly_the_price_ceiling_is_taken_and_one_above_it_is_not():
    plan = schedule(snapshot([], [job("j", gpus=8, max_price_per_hour=32.0)], [offer("p4", price=32.0)]), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([], [job("j", gpus=8, max_price_per_hour=31.5)], [offer("p4", price=32.0)]))
    assert reason.code == ReasonCode.PRICE_CEILING
    assert reason.data["offer_rejections"] == {"price_ceiling": 1}


def test_a_job_that_fills_the_gpu_quota_exactly_is_placed_and_one_more_gpu_is_refused():
    tenants = [budget(gpu_quota=4, gpus_in_use=2)]
    plan = schedule(snapshot([gpu_node("n")], [job("j", gpus=2)], tenants=tenants), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([gpu_node("n")], [job("j", gpus=3)], tenants=tenants))
    assert reason.code == ReasonCode.QUOTA_EXCEEDED
    assert reason.message == ("QUOTA_EXCEEDED: 0/1 nodes fit: 1 would exceed tenant acme's GPU/CU quota; "
                              "no cloud offers")


def test_a_job_that_fills_the_compute_unit_quota_exactly_is_placed_and_one_more_is_refused():
    # An A100 is 1 CU (engine_factories.MODELS).
    tenants = [budget(cu_quota=4, cu_in_use=2)]
    plan = schedule(snapshot([gpu_node("n")], [job("j", gpus=2)], tenants=tenants), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([gpu_node("n")], [job("j", gpus=3)], tenants=tenants))
    assert reason.code == ReasonCode.QUOTA_EXCEEDED
    assert reason.data["rejections"] == {"tenant_quota": 1}, "refused by the quota filter, node by node"


def test_a_run_that_costs_exactly_the_budget_left_is_placed_and_a_dollar_more_is_not():
    pending = [job("j", gpus=8, expected_duration_hours=10)]  # 10 h at $21/h: $210
    plan = schedule(snapshot([], pending, [offer("p4", price=21.0)], tenants=[budget(remaining_budget=210.0)]), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([], pending, [offer("p4", price=21.0)], tenants=[budget(remaining_budget=209.0)]))
    assert reason.code == ReasonCode.BUDGET_EXCEEDED
    assert reason.data["offer_rejections"] == {"tenant_budget": 1}


def test_a_run_that_costs_exactly_the_owners_budget_left_is_placed_and_a_dollar_more_is_not():
    pending = [job("j", gpus=8, expected_duration_hours=10, owner="alice")]

    def alice_left(left):
        return [budget(owners=(OwnerBudget(owner="alice", remaining_budget=left, monthly_budget=500.0),))]

    plan = schedule(snapshot([], pending, [offer("p4", price=21.0)], tenants=alice_left(210.0)), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([], pending, [offer("p4", price=21.0)], tenants=alice_left(209.0)))
    assert reason.code == ReasonCode.BUDGET_EXCEEDED
    assert reason.data["user_budget_left"] == 209.0
    assert reason.data["offer_rejections"] == {"tenant_budget": 1}, "refused by the budget filter"


def test_quotas_count_the_gpus_of_the_model_the_job_would_get():
    # 4 CU on an H100 (2 CU each) is 2 GPUs: within a GPU quota of 2. On A100s it would be 4.
    h100 = gpu_node("h", model="H100", memory_mb=80 * 1024)
    plan = schedule(snapshot([h100], [job("j", compute_units=4.0)], tenants=[budget(gpu_quota=2)]), FAST)
    assert plan.placement_for("j") is not None and len(plan.placement_for("j").gpu_indices) == 2
    # 2 H100s are 4 CU: over a CU quota of 3, though 2 GPUs of a 1-CU model would fit.
    reason = reason_of(snapshot([h100], [job("j", gpus=2)], tenants=[budget(cu_quota=3)]))
    assert reason.code == ReasonCode.QUOTA_EXCEEDED
    assert reason.data["rejections"] == {"tenant_quota": 1}


# -- NVLink islands --------------------------------------------------------------------------------
def test_a_multi_gpu_job_that_does_not_ask_for_nvlink_takes_gpus_across_islands():
    node = gpu_node("n", gpus=8, island_size=4, used=busy(0, 1, 4, 5))
    plan = schedule(snapshot([node], [job("j", gpus=4)]), FAST)
    assert sorted(plan.placement_for("j").gpu_indices) == [2, 3, 6, 7]


def test_a_one_gpu_job_asking_for_nvlink_needs_no_island():
    pcie = gpu_node("n", gpus=4, island_size=1)
    plan = schedule(snapshot([pcie], [job("j", gpus=1, interconnect="nvlink")]), FAST)
    assert plan.placement_for("j") is not None


def test_two_free_gpus_in_different_islands_are_no_island_for_a_two_gpu_nvlink_job():
    node = gpu_node("n", gpus=8, island_size=4, used=busy(0, 1, 2, 4, 5, 6))
    reason = reason_of(snapshot([node], [job("j", gpus=2, interconnect="nvlink")]))
    assert reason.code == ReasonCode.NO_NVLINK_ISLAND
    assert "1 lack a free NVLink island of 2" in reason.message


# -- what a node must be and have -------------------------------------------------------------------
def test_a_node_whose_gpus_all_failed_is_not_ready_for_a_gpu_job():
    node = gpu_node("n", gpus=2, unhealthy=(0, 1))
    reason = reason_of(snapshot([node], [job("j", gpus=1)]))
    assert reason.code == ReasonCode.NODE_NOT_READY
    assert "1 are not ready or have no healthy GPU" in reason.message


def test_a_cpu_only_job_runs_on_a_node_whose_gpus_are_all_busy():
    node = gpu_node("n", gpus=2, used=busy(0, 1))
    plan = schedule(snapshot([node], [job("j", gpus=0)]), FAST)
    assert plan.placement_for("j") is not None


def test_a_job_that_takes_exactly_the_free_cpu_and_memory_is_placed():
    node = gpu_node("n", free_cpu=4000, free_mem=8192)
    plan = schedule(snapshot([node], [job("j", cpu_milli=4000, memory_mb=8192)]), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([node], [job("j", cpu_milli=4001, memory_mb=8192)]))
    assert reason.code == ReasonCode.INSUFFICIENT_CPU_MEMORY


def test_a_job_limited_to_a_region_runs_there():
    plan = schedule(snapshot([gpu_node("n", region="dc1")], [job("j", regions=("dc1",))]), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([gpu_node("n", region="dc2")], [job("j", regions=("dc1",))]))
    assert reason.code == ReasonCode.PROVIDER_REGION


def test_a_node_selector_picks_the_node_with_the_labels():
    plain = gpu_node("plain")
    labelled = replace(gpu_node("labelled"), labels={"disk": "nvme", "zone": "a"})
    plan = schedule(snapshot([plain, labelled], [job("j", node_selector=(("disk", "nvme"),))]), FAST)
    assert plan.placement_for("j").node_id == "labelled"
    reason = reason_of(snapshot([plain], [job("j", node_selector=(("disk", "nvme"),))]))
    assert reason.code == ReasonCode.NODE_SELECTOR


def test_a_container_job_runs_on_a_node_with_a_runtime():
    plan = schedule(snapshot([replace(gpu_node("n"), container_runtimes=("podman",))],
                             [job("j", needs_container=True)]), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([gpu_node("n")], [job("j", needs_container=True)]))
    assert reason.code == ReasonCode.NO_CONTAINER_RUNTIME


def test_a_node_that_hands_out_whole_gpus_takes_whole_gpu_jobs_but_not_shares():
    kube = replace(gpu_node("k"), labels={"whalezen.io/gpu-sharing": "none"})
    plan = schedule(snapshot([kube], [job("j")]), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([kube], [job("j", gpu_milli=500)]))
    assert reason.code == ReasonCode.NO_GPU_SHARING


def test_a_share_fits_beside_other_shares_on_a_partly_used_gpu():
    node = gpu_node("n", gpus=2, used=busy(0, 1, milli=300))
    plan = schedule(snapshot([node], [job("j", gpu_milli=500)]), FAST)
    assert plan.placement_for("j") is not None


# -- offers ----------------------------------------------------------------------------------------
def test_a_job_that_must_not_run_on_spot_gets_the_on_demand_instance():
    plan = schedule(snapshot([], [job("j", spot="never")], [offer("p4", price=32.0, spot=10.0)]), FAST)
    assert plan.placement_for("j") is not None and not plan.placement_for("j").spot


def test_an_offer_of_another_teams_account_is_not_rented_for_us():
    theirs = replace(offer("p4"), tenants=("globex",))
    reason = reason_of(snapshot([], [job("j")], [theirs]))
    assert reason.code == ReasonCode.NO_POOL_ACCESS
    plan = schedule(snapshot([], [job("j", tenant="globex")], [theirs], tenants=[budget("globex")]), FAST)
    assert plan.placement_for("j") is not None


# -- names a policy gets wrong ---------------------------------------------------------------------
def test_an_unknown_filter_or_score_is_named_with_the_known_ones():
    with pytest.raises(KeyError, match=r"unknown filter plugins \['no_such_plugin'\]; known: \['container_runtime'"):
        resolve_filters(("gpu_model", "no_such_plugin"))
    with pytest.raises(KeyError, match=r"unknown score terms \['carbon'\]; known: \['fragmentation', 'money', "
                                       r"'waiting'\]"):
        resolve_scores({"money": 1.0, "carbon": 1.0})


# -- teams' quotas of owned GPUs ---------------------------------------------------------------------
STRICT = replace(FAST, borrowing=False)


def test_under_strict_quotas_a_job_past_its_teams_nominal_is_told_so_not_that_others_took_the_capacity():
    snap = snapshot([gpu_node("n", price=0.0)], [job("big", gpus=4)],
                    quotas=(QuotaShare("acme", "A100", 2.0), QuotaShare("globex", "A100", 6.0)))
    plan = schedule(snap, STRICT)
    assert plan.placement_for("big") is None
    reason = plan.pending["big"]
    assert reason.code == ReasonCode.NOMINAL_QUOTA_USED
    assert "0/1 nodes fit: 1 would take team acme past its quota of owned GPUs" in reason.message
    assert "CAPACITY_TAKEN" not in reason.message
    assert reason.data["rejections"] == {"team_quota": 1}


def test_a_compute_unit_job_counts_against_a_teams_quota_in_gpus_of_the_model_it_gets():
    # 4 CU on H100s (2 CU each) is 2 GPUs: exactly the team's nominal 2 H100s.
    h100 = gpu_node("h", model="H100", memory_mb=80 * 1024, price=0.0)
    snap = snapshot([h100], [job("cu", compute_units=4.0)],
                    quotas=(QuotaShare("acme", "H100", 2.0), QuotaShare("globex", "H100", 6.0)))
    placement = schedule(snap, STRICT).placement_for("cu")
    assert placement is not None and len(placement.gpu_indices) == 2


# -- GPU memory ------------------------------------------------------------------------------------
def test_a_job_asking_for_any_gpu_memory_at_all_is_told_memory_is_short_where_none_is_free():
    # Whole GPUs free by share, their memory filled (by something outside the scheduler): a job that
    # asks for 1 MB is short of GPU memory, not of GPUs; one that asks for none is placed.
    node = gpu_node("n", gpus=2, free_memory={0: 0, 1: 0})
    reason = reason_of(snapshot([node], [job("j", min_gpu_memory_mb=1)]))
    assert reason.code == ReasonCode.INSUFFICIENT_GPU_MEMORY
    assert schedule(snapshot([node], [job("j")]), FAST).placement_for("j") is not None
