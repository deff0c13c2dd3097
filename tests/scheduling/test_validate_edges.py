"""The plan validator, check by check, on hand-written plans: each test breaks one rule a plan must
keep and asserts the exact list of problems (so a check that goes quiet, or one that complains about
a plan that keeps the rule, fails here). Boundaries are tested on both sides: a plan that uses a
limit exactly is fine, one unit past it is not. The engine never makes most of these plans; the
validator is what tests, the simulator and the broker trust to catch the one that would."""

from __future__ import annotations

from dataclasses import replace

from engine_factories import budget, gpu_node, job, offer, snapshot
from scheduling.model import (
    GpuModelInfo, Launch, LaunchLimit, Migration, Placement, PlacementPart, Plan, Preemption, QuotaShare, Reason,
    ReasonCode, RunningAllocation,
)
from scheduling.validate import plan_violations


def node(node_id: str = "a", **fields):
    fields.setdefault("price", 0.0)
    return gpu_node(node_id, **fields)


def on(node_id: str, *gpus: int, milli: int = 1000) -> PlacementPart:
    return PlacementPart(gpu_indices=tuple(gpus), gpu_milli=milli, node_id=node_id)


def on_launch(launch_id: str, *gpus: int, instance: int = 0) -> PlacementPart:
    return PlacementPart(gpu_indices=tuple(gpus), launch_id=launch_id, instance=instance)


def placed(job_id: str, *parts: PlacementPart, model: str = "A100", price: float = 0.0, spot: bool = False):
    return Placement(job_id=job_id, parts=tuple(parts), gpu_model=model, price_per_hour=price, spot=spot)


def launch(launch_id: str = "L1", offer_id: str = "o", count: int = 1, price: float = 32.0, spot: bool = False,
           jobs: tuple[str, ...] = ()) -> Launch:
    return Launch(launch_id=launch_id, offer_id=offer_id, count=count, spot=spot, job_ids=jobs, price_per_hour=price)


def waiting(message: str = "INSUFFICIENT_GPUS: no node has a free GPU") -> Reason:
    return Reason(ReasonCode.INSUFFICIENT_GPUS, message)


def check(snap, *placements, **plan_fields) -> list[str]:
    return plan_violations(snap, Plan(placements=tuple(placements), **plan_fields))


# ----------------------------------------------------------------------------- a plan that keeps every rule


def test_a_plan_that_keeps_every_rule_has_no_problems():
    nodes = [node("a", island_size=4), node("b", fast_fabric=True), node("c", fast_fabric=True)]
    jobs = [job("one"), job("pair", gpus=2, interconnect="nvlink"), job("gang", gpus=16, nodes=2),
            job("half", gpus=1, gpu_milli=500), job("cu", gpus=0, compute_units=2.0), job("rent", gpus=8),
            job("later", gpus=4), job("zero", nodes=0)]
    plan = Plan(
        placements=(placed("one", on("a", 0)), placed("pair", on("a", 4, 5)),
                    placed("gang", on("b", *range(8)), on("c", *range(8))),
                    placed("half", on("a", 1, milli=500)), placed("cu", on("a", 2, 3)),
                    placed("rent", on_launch("L1", *range(8)), price=32.0), placed("zero", on("a", 6))),
        launches=(launch(jobs=("rent",)),),
        pending={"later": waiting()})
    snap = snapshot(nodes, jobs, [offer("o", launchable=1)])
    assert plan_violations(snap, plan) == []


# ----------------------------------------------------------------------------- every pending job accounted for


def test_a_job_neither_placed_nor_given_a_reason_is_named():
    snap = snapshot([node()], [job("j"), job("k")])
    assert check(snap, placed("k", on("a", 0))) == ["j: neither placed nor given a pending reason"]


def test_a_job_both_placed_and_pending_is_named():
    snap = snapshot([node()], [job("j")])
    assert check(snap, placed("j", on("a", 0)), pending={"j": waiting()}) == ["j: both placed and pending"]


def test_a_reason_whose_message_does_not_start_with_its_code_is_named():
    snap = snapshot([node()], [job("j"), job("k")])
    assert check(snap, pending={"j": waiting("no node has a free GPU"), "k": waiting("")}) == [
        "j: reason message does not start with its code", "k: reason message does not start with its code"]
    assert check(snap, pending={"j": waiting(), "k": waiting("INSUFFICIENT_GPUS")}) == []


def test_a_placement_of_a_job_that_is_not_pending_is_named_and_not_checked_further():
    snap = snapshot([node()], [])
    assert check(snap, placed("ghost", on("a", 9), on("zz", 0))) == ["ghost: placed but not pending"]


# ----------------------------------------------------------------------------- gangs


def test_a_gang_must_have_one_part_per_node():
    fast = [node("a", fast_fabric=True), node("b", fast_fabric=True)]
    snap = snapshot(fast + [node("c", fast_fabric=True)], [job("g", gpus=16, nodes=2), job("j")])
    assert check(snap, placed("g", on("a", *range(8))), placed("j", on("b", 0), on("c", 0))) == [
        "g: gang split: 1 parts for 2 nodes", "j: gang split: 2 parts for 1 nodes"]


def test_two_parts_of_a_gang_on_one_node_or_one_instance_are_refused():
    snap = snapshot([node("a", fast_fabric=True)], [job("g", gpus=8, nodes=2)], [offer("o", fast_fabric=True)])
    assert check(snap, placed("g", on("a", 0, 1, 2, 3), on("a", 4, 5, 6, 7))) == [
        "g: two parts of one gang on the same node"]
    one_instance = placed("g", on_launch("L1", 0, 1, 2, 3), on_launch("L1", 4, 5, 6, 7), price=64.0)
    assert check(snap, one_instance, launches=(launch(count=2),)) == ["g: two parts of one gang on the same node"]
    two_instances = placed("g", on_launch("L1", 0, 1, 2, 3), on_launch("L1", 0, 1, 2, 3, instance=1), price=64.0)
    assert check(snap, two_instances, launches=(launch(count=2),)) == []


def test_a_gang_may_not_mix_owned_nodes_and_launches_nor_two_launches():
    snap = snapshot([node("a", fast_fabric=True)], [job("g", gpus=16, nodes=2)],
                    [offer("o", fast_fabric=True, launchable=3)])
    mixed = placed("g", on("a", *range(8)), on_launch("L1", *range(8)))
    assert check(snap, mixed, launches=(launch(),)) == ["g: gang spread over owned nodes and launches"]
    two = placed("g", on_launch("L1", *range(8)), on_launch("L2", *range(8)))
    assert check(snap, two, launches=(launch(), launch("L2"))) == ["g: gang spread over owned nodes and launches"]


def test_a_gang_on_a_node_the_snapshot_lacks_has_no_fast_fabric():
    snap = snapshot([node("a", fast_fabric=True)], [job("g", gpus=16, nodes=2)])
    assert check(snap, placed("g", on("a", *range(8)), on("zz", *range(8)))) == [
        "g: multi-node gang without a fast fabric", "g: unknown node or launch zz"]


# ----------------------------------------------------------------------------- GPUs


def test_each_part_holds_the_jobs_gpus_divided_over_its_nodes():
    fast = [node("a", fast_fabric=True), node("b", fast_fabric=True)]
    snap = snapshot(fast, [job("j", gpus=2), job("g", gpus=16, nodes=2)])
    assert check(snap, placed("j", on("a", 0)), placed("g", on("a", *range(1, 8)), on("b", *range(8)))) == [
        "j: 1 GPUs on a, wants 2", "g: 7 GPUs on a, wants 8"]


def test_a_compute_unit_ask_needs_the_gpus_its_model_rating_gives():
    models = (GpuModelInfo("A100", 1.0), GpuModelInfo("H100", 2.0), GpuModelInfo("Z", 0.0))
    snap = snapshot([node("a"), node("h", model="H100"), node("z", model="Z")],
                    [job("a4", gpus=0, compute_units=4.0), job("h4", gpus=0, compute_units=4.0),
                     job("z2", gpus=0, compute_units=2.0)], gpu_models=models)
    assert check(snap, placed("a4", on("a", 0, 1, 2, 3)), placed("h4", on("h", 0, 1), model="H100"),
                 placed("z2", on("z", 0, 1), model="Z")) == []
    assert check(snap, placed("a4", on("a", 0, 1)), placed("h4", on("h", 0, 1, 2, 3), model="H100"),
                 placed("z2", on("z", 0), model="Z")) == [
        "a4: 2 GPUs on a, wants 4", "h4: 4 GPUs on h, wants 2", "z2: 1 GPUs on z, wants 2"]


def test_a_gpu_listed_twice_is_named_and_counted_twice():
    snap = snapshot([node()], [job("j", gpus=2)])
    assert check(snap, placed("j", on("a", 0, 0))) == ["j: a GPU listed twice on a", "j: GPU 0 on a over-allocated"]


def test_a_part_on_something_the_snapshot_or_plan_lacks_is_named():
    snap = snapshot([node()], [job("n"), job("l"), job("i"), job("x"), job("g")], [offer("o")])
    nowhere = PlacementPart(gpu_indices=(0,))
    plan = Plan(placements=(placed("n", on("zz", 0)), placed("l", on_launch("L9", 0)),
                            placed("i", on_launch("L1", 0, instance=1)), placed("x", nowhere),
                            placed("g", on("a", 8))),
                launches=(launch(),))
    assert plan_violations(snap, plan) == [
        "n: unknown node or launch zz", "l: unknown node or launch L9", "i: unknown node or launch L1",
        "x: unknown node or launch ?", "g: no GPU 8 on a"]


def test_a_launch_has_the_offers_gpus_and_no_more():
    snap = snapshot([], [job("j"), job("k")], [offer("o", gpus=4)])
    plan = Plan(placements=(placed("j", on_launch("L1", 3)), placed("k", on_launch("L1", 4))), launches=(launch(),))
    assert plan_violations(snap, plan) == ["k: no GPU 4 on L1"]


def test_shares_of_a_gpu_may_fill_it_and_not_more():
    snap = snapshot([node(used={1: 500, 2: 400, 4: 401})],
                    [job(f"h{i}", gpu_milli=500) for i in range(4)] + [job("s", gpu_milli=600)])
    fits = [placed("h0", on("a", 0, milli=500)), placed("h1", on("a", 0, milli=500)),
            placed("h2", on("a", 1, milli=500)), placed("s", on("a", 2, milli=600)), placed("h3", on("a", 3, milli=500))]
    assert check(snap, *fits) == []
    over = [placed("h0", on("a", 0, milli=500)), placed("h1", on("a", 0, milli=500)), placed("h2", on("a", 0, milli=500)),
            placed("h3", on("a", 1, milli=500)), placed("s", on("a", 4, milli=600))]
    assert check(snap, *over) == ["h2: GPU 0 on a over-allocated", "s: GPU 4 on a over-allocated"]


def test_a_whole_gpu_already_in_use_is_over_allocated():
    snap = snapshot([node(used={3: 1000})], [job("j"), job("h", gpu_milli=1)])
    assert check(snap, placed("j", on("a", 3)), placed("h", on("a", 3, milli=1))) == [
        "j: GPU 3 on a over-allocated", "h: GPU 3 on a over-allocated"]


def test_an_unhealthy_gpu_is_refused_even_for_a_share():
    snap = snapshot([node(unhealthy=(2,))], [job("j"), job("h", gpu_milli=1)])
    assert check(snap, placed("j", on("a", 2)), pending={"h": waiting()}) == [
        "j: GPU 2 on a over-allocated", "j: GPU 2 on a is unhealthy"]
    assert check(snap, placed("h", on("a", 2, milli=1)), pending={"j": waiting()}) == [
        "h: GPU 2 on a over-allocated", "h: GPU 2 on a is unhealthy"]


def test_a_gpu_model_the_job_does_not_allow_is_named():
    snap = snapshot([node()], [job("j", allowed_models=("H100", "T4")), job("k", allowed_models=("T4", "A100"))])
    assert check(snap, placed("j", on("a", 0)), placed("k", on("a", 1))) == ["j: GPU model A100 not allowed"]


def test_an_nvlink_job_stays_on_one_island():
    snap = snapshot([node("a", island_size=4), node("p", island_size=1)],
                    [job("across", gpus=2, interconnect="nvlink"), job("none", gpus=2, interconnect="nvlink"),
                     job("single", interconnect="nvlink"), job("pcie", gpus=2, interconnect="pcie"),
                     job("any", gpus=2)])
    assert check(snap, placed("across", on("a", 3, 4)), placed("none", on("p", 0, 1)), placed("single", on("p", 2)),
                 placed("pcie", on("a", 2, 5)), placed("any", on("p", 3, 4))) == [
        "across: NVLink gang not on one island of a", "none: NVLink gang not on one island of p"]
    assert check(snap, placed("across", on("a", 4, 5)), placed("none", on("a", 0, 1)), placed("single", on("a", 2)),
                 placed("pcie", on("a", 3, 6)), placed("any", on("p", 3, 4))) == []


def test_an_nvlink_job_on_a_launch_needs_an_offer_with_nvlink():
    snap = snapshot([], [job("j", gpus=2, interconnect="nvlink")], [offer("nv"), offer("pci", nvlink=False)])
    assert check(snap, placed("j", on_launch("L1", 0, 1)), launches=(launch(offer_id="nv"),)) == []
    assert check(snap, placed("j", on_launch("L1", 0, 1)), launches=(launch(offer_id="pci"),)) == [
        "j: NVLink gang not on one island of L1"]


# ----------------------------------------------------------------------------- host CPU and memory


def test_cpu_and_memory_of_a_node_may_be_used_exactly_and_not_more():
    snap = snapshot([node("c", free_cpu=2000), node("m", free_mem=2048)],
                    [job(f"j{i}") for i in range(3)] + [job(f"k{i}") for i in range(3)])
    assert check(snap, placed("j0", on("c", 0)), placed("j1", on("c", 1)), placed("k0", on("m", 0)),
                 placed("k1", on("m", 1)), pending={"j2": waiting(), "k2": waiting()}) == []
    assert check(snap, placed("j0", on("c", 0)), placed("j1", on("c", 1)), placed("j2", on("c", 2)),
                 placed("k0", on("m", 0)), placed("k1", on("m", 1)), placed("k2", on("m", 2))) == [
        "c#0: CPU or memory over-allocated", "m#0: CPU or memory over-allocated"]


def test_cpu_and_memory_of_a_launch_are_the_offers_per_instance():
    snap = snapshot([], [job("fits", cpu_milli=96_000, memory_mb=1024 * 1024), job("cpu", cpu_milli=96_001),
                         job("mem", memory_mb=1024 * 1024 + 1)], [offer("o", launchable=3)])
    assert check(snap, placed("fits", on_launch("L1", 0)), placed("cpu", on_launch("L1", 0, instance=1)),
                 placed("mem", on_launch("L1", 0, instance=2)), launches=(launch(count=3),)) == [
        "L1#1: CPU or memory over-allocated", "L1#2: CPU or memory over-allocated"]


# ----------------------------------------------------------------------------- price, spot


def test_a_placement_may_cost_its_ceiling_and_not_more():
    snap = snapshot([node()], [job("at", max_price_per_hour=2.0), job("over", max_price_per_hour=2.0)])
    assert check(snap, placed("at", on("a", 0), price=2.0), placed("over", on("a", 1), price=2.0000001)) == []
    assert check(snap, placed("at", on("a", 0), price=2.0), placed("over", on("a", 1), price=2.5)) == [
        "over: $2.50/h above its ceiling"]


def test_spot_policies_never_and_required():
    snap = snapshot([node()], [job("never", spot="never"), job("required", spot="required"),
                               job("owned", spot="required")], [offer("o", spot=10.0, launchable=2)])
    plan = Plan(placements=(placed("never", on_launch("L1", 0), spot=True, price=10.0),
                            placed("required", on_launch("L2", 0), price=32.0),
                            placed("owned", on("a", 0))),
                launches=(launch(spot=True, price=10.0), launch("L2")))
    assert plan_violations(snap, plan) == ["never: spot policy never broken", "required: spot policy required broken"]
    plan = Plan(placements=(placed("never", on_launch("L2", 0), price=32.0),
                            placed("required", on_launch("L1", 0), spot=True, price=10.0),
                            placed("owned", on("a", 0))),
                launches=(launch(spot=True, price=10.0), launch("L2")))
    assert plan_violations(snap, plan) == []


# ----------------------------------------------------------------------------- tenant quotas and budgets


def test_a_tenants_gpu_quota_counts_shares_and_what_is_in_use():
    snap = snapshot([node()], [job("w"), job("h", gpu_milli=500), job("other", tenant="globex")],
                    tenants=[budget(gpu_quota=2.0, gpus_in_use=0.5), budget("globex")])
    fits = [placed("w", on("a", 0)), placed("h", on("a", 1, milli=500)), placed("other", on("a", 2))]
    assert check(snap, *fits) == []
    snap = replace(snap, tenants=(budget(gpu_quota=2.0, gpus_in_use=0.6), budget("globex", gpu_quota=0.0)))
    assert check(snap, *fits) == ["tenant acme: GPU quota exceeded", "tenant globex: GPU quota exceeded"]


def test_a_tenants_cu_quota_counts_the_models_rating():
    snap = snapshot([node("h", model="H100")], [job("j"), job("k")], tenants=[budget(cu_quota=5.0, cu_in_use=1.0)])
    assert check(snap, placed("j", on("h", 0), model="H100"), placed("k", on("h", 1), model="H100")) == []
    snap = replace(snap, tenants=(budget(cu_quota=5.0, cu_in_use=1.5),))
    assert check(snap, placed("j", on("h", 0), model="H100"), placed("k", on("h", 1), model="H100")) == [
        "tenant acme: CU quota exceeded"]


def test_a_tenants_budget_covers_price_times_expected_hours_on_the_model():
    # 2 h at A100 speed: $3/h on an A100 costs $6, on an H100 (twice as fast) $3.
    snap = snapshot([node(), node("h", model="H100")],
                    [job("j", expected_duration_hours=2.0), job("k", expected_duration_hours=2.0)],
                    tenants=[budget(remaining_budget=9.0)])
    plan = (placed("j", on("a", 0), price=3.0), placed("k", on("h", 0), model="H100", price=3.0))
    assert check(snap, *plan) == []
    snap = replace(snap, tenants=(budget(remaining_budget=8.99),))
    assert check(snap, *plan) == ["tenant acme: budget exceeded"]


def test_the_money_of_a_compute_unit_ask_is_its_compute_over_what_the_gpus_deliver():
    # 4 CU for 1 h on two H100s (2 CU each) takes 1 h: $5/h costs $5.
    snap = snapshot([node("h", model="H100")], [job("j", gpus=0, compute_units=4.0)], tenants=[budget(remaining_budget=5.0)])
    assert check(snap, placed("j", on("h", 0, 1), model="H100", price=5.0)) == []
    assert check(snap, placed("j", on("h", 0, 1), model="H100", price=5.01)) == ["tenant acme: budget exceeded"]


# ----------------------------------------------------------------------------- launches


def test_a_launch_costs_what_its_offer_says():
    snap = snapshot([], [], [offer("o", spot=10.0, launchable=4)])
    plan = Plan(launches=(launch("od", price=32.0), launch("sp", spot=True, price=10.0),
                          launch("cheap", price=31.0), launch("spod", spot=True, price=32.0)))
    assert plan_violations(snap, plan) == ["cheap: price does not match the offer", "spod: price does not match the offer"]


def test_an_offer_may_be_launched_up_to_its_launchable_count():
    snap = snapshot([], [], [offer("o", launchable=3), offer("p", launchable=1)])
    assert plan_violations(snap, Plan(launches=(launch("L1", count=2), launch("L2", count=1), launch("L3", "p")))) == []
    assert plan_violations(snap, Plan(launches=(launch("L1", count=2), launch("L2", count=2), launch("L3", "p")))) == [
        "offer o: 4 launches above its launchable count"]
    assert plan_violations(snap, Plan(launches=(launch("L1", "gone"),))) == ["offer gone: 1 launches above its launchable count"]


def test_a_pools_offers_together_stay_within_its_instance_cap():
    pool = [replace(offer("o"), launch_group="pool"), replace(offer("p"), launch_group="pool"),
            replace(offer("q"), launch_group="other")]
    snap = snapshot([], [], pool, launch_limits=(LaunchLimit("pool", 2), LaunchLimit("idle", 0)))
    assert plan_violations(snap, Plan(launches=(launch("L1"), launch("L2", "p"), launch("L3", "q", count=2)))) == []
    assert plan_violations(snap, Plan(launches=(launch("L1", count=2), launch("L2", "p")))) == [
        "launch group pool: 3 launches above its cap of 2 more"]


# ----------------------------------------------------------------------------- moves


def running(job_id: str = "r", node_id: str = "a", gpus=(0, 1), **fields) -> RunningAllocation:
    fields.setdefault("preemptible", True)
    fields.setdefault("checkpointable", True)
    fields.setdefault("cpu_milli", 1000)
    fields.setdefault("memory_mb", 1024)
    fields.setdefault("demand", job(job_id, gpus=len(gpus)))
    return RunningAllocation(job_id=job_id, node_id=node_id, gpu_indices=tuple(gpus), **fields)


def move(job_id: str = "r", source: str = "a", to: str | None = "b", gpus=(0, 1), milli: int = 1000) -> Migration:
    return Migration(job_id=job_id, from_node_id=source, to=PlacementPart(tuple(gpus), milli, to),
                     reason="defragmentation")


def moves(snap, *migrations, placements=(), preemptions=()) -> list[str]:
    return plan_violations(snap, Plan(placements=tuple(placements), migrations=tuple(migrations),
                                      preemptions=tuple(preemptions)))


def two_nodes(**b_fields):
    return [node("a", used={0: 1000, 1: 1000}), node("b", **b_fields)]


def test_a_move_of_a_running_movable_job_to_free_gpus_is_fine():
    assert moves(snapshot(two_nodes(), running=[running()]), move()) == []


def test_a_move_of_a_job_that_is_not_running_is_named():
    assert moves(snapshot(two_nodes(), running=[running()]), move("zz")) == ["zz: moved but not running"]


def test_a_job_moved_twice_or_moved_and_preempted_is_named():
    snap = snapshot(two_nodes(), running=[running()])
    assert moves(snap, move(), move(gpus=(2, 3))) == ["r: moved twice, or moved and preempted"]
    stop = Preemption(victim_job_id="r", for_job_id="x", node_id="a", lost_work_s=0.0)
    assert moves(snap, move(), preemptions=[stop]) == ["r: moved twice, or moved and preempted"]


def test_a_move_must_leave_the_node_the_job_runs_on():
    snap = snapshot(two_nodes(), running=[running()])
    assert moves(snap, move(source="b")) == ["r: move from b to b does not leave a"]
    assert moves(snap, move(to="a", gpus=(2, 3))) == ["r: move from a to a does not leave a"]
    assert moves(snap, move(to=None)) == ["r: move from a to None does not leave a", "r: unknown node ?"]


def test_only_a_checkpointable_preemptible_job_moves():
    for fields in ({"checkpointable": False}, {"preemptible": False}):
        snap = snapshot(two_nodes(), running=[running(**fields)])
        assert moves(snap, move()) == ["r: moved but not checkpointable and preemptible"]


def test_a_move_onto_gpus_that_are_missing_taken_unhealthy_or_of_a_refused_model_is_named():
    snap = snapshot(two_nodes(used={1: 1}, unhealthy=(2,)), running=[running()])
    assert moves(snap, move(to="zz")) == ["r: unknown node zz"]
    assert moves(snap, move(gpus=(0, 9))) == ["r: no GPU 9 on b"]
    assert moves(snap, move(gpus=(1, 2))) == ["r: GPU 1 on b over-allocated or unhealthy",
                                              "r: GPU 2 on b over-allocated or unhealthy"]
    picky = snapshot(two_nodes(), running=[running(demand=job("r", gpus=2, allowed_models=("H100",)))])
    assert moves(picky, move()) == ["r: GPU model A100 not allowed", "r: GPU model A100 not allowed"]
    unknown_demand = snapshot(two_nodes(), running=[running(demand=None)])
    assert moves(unknown_demand, move()) == []


def test_a_share_may_move_onto_what_is_left_of_a_gpu_and_not_more():
    snap = snapshot(two_nodes(used={0: 500, 1: 501}), running=[running(gpus=(0,), gpu_milli=500)])
    assert moves(snap, move(gpus=(0,), milli=500)) == []
    assert moves(snap, move(gpus=(1,), milli=500)) == ["r: GPU 1 on b over-allocated or unhealthy"]


def test_a_move_and_a_placement_on_one_gpu_collide():
    snap = snapshot(two_nodes(), [job("j")], running=[running()])
    assert moves(snap, move(), placements=[placed("j", on("b", 1))]) == ["r: GPU 1 on b over-allocated or unhealthy"]


def test_a_move_brings_its_cpu_and_memory_to_the_destination():
    for fields in ({"free_cpu": 1999}, {"free_mem": 2047}):
        snap = snapshot(two_nodes(**fields), [job("j")], running=[running()])
        assert moves(snap, move(), placements=[placed("j", on("b", 2))]) == ["b#0: CPU or memory over-allocated"]
    snap = snapshot(two_nodes(free_cpu=2000, free_mem=2048), [job("j")], running=[running()])
    assert moves(snap, move(), placements=[placed("j", on("b", 2))]) == []


def test_a_later_move_may_take_what_an_earlier_move_leaves_and_not_the_other_way_round():
    # r leaves a (GPUs 0-1, all a's free CPU and memory); s comes from c onto the same GPUs.
    nodes = [node("a", used={0: 1000, 1: 1000}, free_cpu=0, free_mem=0), node("b"), node("c", used={0: 1000, 1: 1000})]
    snap = snapshot(nodes, running=[running(), running("s", "c")])
    out, into = move(), move("s", "c", "a")
    assert moves(snap, out, into) == []
    assert moves(snap, into, out) == ["s: GPU 0 on a over-allocated or unhealthy",
                                      "s: GPU 1 on a over-allocated or unhealthy"]


# ----------------------------------------------------------------------------- pool access


def test_a_team_is_placed_only_where_it_has_access():
    nodes = [node("mine", tenants=("acme",)), node("theirs", tenants=("globex",)), node("open")]
    offers = [replace(offer("o"), tenants=("globex", "initech")), offer("any")]
    snap = snapshot(nodes, [job(n) for n in ("a", "b", "c", "d", "e")], offers)
    plan = Plan(placements=(placed("a", on("mine", 0)), placed("b", on("theirs", 0)), placed("c", on("open", 0)),
                            placed("d", on_launch("L1", 0), price=32.0), placed("e", on_launch("L2", 0), price=32.0)),
                launches=(launch(), launch("L2", "any")))
    assert plan_violations(snap, plan) == ["b: team acme placed where it has no access",
                                           "d: team acme placed where it has no access"]


# ----------------------------------------------------------------------------- quotas of shared owned capacity


def share(team: str, nominal: float, flavor: str = "A100", **fields) -> QuotaShare:
    return QuotaShare(team, flavor, nominal, **fields)


def team_jobs(team: str, count: int, **fields):
    return [job(f"{team}{i}", tenant=team, **fields) for i in range(count)]


def team_places(team: str, count: int, node_id: str = "a", start: int = 0, milli: int = 1000):
    return [placed(f"{team}{i}", on(node_id, start + i, milli=milli)) for i in range(count)]


def test_a_team_borrows_up_to_its_borrowing_limit_and_not_past_it():
    quotas = (share("acme", 4, borrowing_limit=2), share("globex", 4))
    snap = snapshot([node()], team_jobs("acme", 7), quotas=quotas,
                    running=[running("old", "a", (7,), tenant="acme", demand=None)])
    assert check(snap, *team_places("acme", 5), pending={"acme5": waiting(), "acme6": waiting()}) == []
    assert check(snap, *team_places("acme", 6), pending={"acme6": waiting()}) == [
        "team acme: 7 A100 is past nominal 4 + borrowing limit 2"]


def test_borrowing_limits_are_checked_per_team_in_name_order_with_fractions():
    quotas = (share("zeta", 1, borrowing_limit=0.5), share("acme", 0, borrowing_limit=0))
    snap = snapshot([node()], team_jobs("zeta", 4, gpu_milli=500) + team_jobs("acme", 1), quotas=quotas)
    assert check(snap, *team_places("zeta", 3, milli=500), pending={"zeta3": waiting(), "acme0": waiting()}) == []
    assert check(snap, *team_places("zeta", 4, milli=500), *team_places("acme", 1, start=5)) == [
        "team acme: 1 A100 is past nominal 0 + borrowing limit 0",
        "team zeta: 2 A100 is past nominal 1 + borrowing limit 0.5"]


def test_jobs_that_cannot_be_preempted_stay_within_the_unused_nominal():
    quotas = (share("acme", 4), share("globex", 4))
    snap = snapshot([node()], team_jobs("acme", 4, preemptible=False),
                    quotas=quotas, running=[running("old", "a", (7,), tenant="acme", demand=None)])
    assert check(snap, *team_places("acme", 3), pending={"acme3": waiting()}) == []
    assert check(snap, *team_places("acme", 4)) == ["team acme: jobs that cannot be preempted borrow A100"]


def test_a_team_already_past_its_nominal_may_not_add_even_a_share_that_cannot_be_preempted():
    quotas = (share("acme", 1), share("globex", 7))
    snap = snapshot([node()], team_jobs("acme", 1, preemptible=False, gpu_milli=100), quotas=quotas,
                    running=[running("old", "a", (6, 7), tenant="acme", demand=None)])
    assert check(snap, *team_places("acme", 1, milli=100)) == ["team acme: jobs that cannot be preempted borrow A100"]


def test_teams_together_use_no_more_than_the_cohort_lends_plus_what_no_quota_names():
    # 16 shared A100s; globex keeps 4 of its 4 from lending: acme may use 4 (lent) + 8 (unassigned).
    quotas = (share("acme", 4), share("globex", 4, lending_limit=0))
    snap = snapshot([node("a"), node("b")], team_jobs("acme", 13), quotas=quotas)
    twelve = team_places("acme", 8) + [placed(f"acme{8 + i}", on("b", i)) for i in range(4)]
    assert check(snap, *twelve, pending={"acme12": waiting()}) == []
    assert check(snap, *twelve, placed("acme12", on("b", 4))) == ["flavor A100: teams use 13 of the cohort's pool of 12"]


def test_a_lending_limit_keeps_only_the_part_above_it_from_others():
    # globex lends 1 of its 4: the pool is 4 + 1, acme may use 5.
    quotas = (share("acme", 4), share("globex", 4, lending_limit=1))
    snap = snapshot([node()], team_jobs("acme", 6), quotas=quotas)
    assert check(snap, *team_places("acme", 5), pending={"acme5": waiting()}) == []
    assert check(snap, *team_places("acme", 6)) == ["flavor A100: teams use 6 of the cohort's pool of 5"]


def test_a_lending_limit_above_the_nominal_reserves_nothing():
    quotas = (share("acme", 4), share("globex", 4, lending_limit=6))
    snap = snapshot([node()], team_jobs("acme", 8), quotas=quotas)
    assert check(snap, *team_places("acme", 8)) == []


def test_use_inside_a_teams_reserve_does_not_count_against_the_pool():
    # globex runs 3 inside the 4 it keeps: acme still has the pool of 4 to itself.
    quotas = (share("acme", 4), share("globex", 4, lending_limit=0))
    snap = snapshot([node()], team_jobs("acme", 4) + team_jobs("globex", 1), quotas=quotas,
                    running=[running("g", "a", (5, 6, 7), tenant="globex", demand=None)])
    assert check(snap, *team_places("acme", 4), *team_places("globex", 1, start=4)) == []


def test_use_already_over_the_pool_is_not_the_plans_fault():
    quotas = (share("acme", 2), share("globex", 6, lending_limit=0))
    held = running("old", "a", (0, 1, 2), tenant="acme", demand=None)
    snap = snapshot([node()], team_jobs("globex", 1) + team_jobs("acme", 1), quotas=quotas, running=[held])
    assert check(snap, *team_places("globex", 1, start=3), pending={"acme0": waiting()}) == []
    assert check(snap, *team_places("globex", 1, start=3), placed("acme0", on("a", 4))) == [
        "flavor A100: teams use 4 of the cohort's pool of 2"]


def test_only_owned_nodes_open_to_several_teams_count():
    quotas = (share("acme", 0, borrowing_limit=0),)
    nodes = [node("rented", rented=True), node("own", tenants=("acme",)), node("shared", tenants=("acme", "globex"))]
    snap = snapshot(nodes, team_jobs("acme", 3), quotas=quotas)
    assert check(snap, placed("acme0", on("rented", 0)), placed("acme1", on("own", 0)),
                 pending={"acme2": waiting()}) == []
    assert check(snap, placed("acme0", on("rented", 0)), placed("acme1", on("own", 0)), placed("acme2", on("shared", 0))) == [
        "team acme: 1 A100 is past nominal 0 + borrowing limit 0"]


def test_unhealthy_gpus_are_not_capacity_of_the_pool():
    quotas = (share("acme", 0),)
    snap = snapshot([node(gpus=2, unhealthy=(1,))], team_jobs("acme", 1), quotas=quotas,
                    running=[running("old", "a", (1,), tenant="acme", demand=None)])
    assert check(snap, placed("acme0", on("a", 0))) == ["flavor A100: teams use 2 of the cohort's pool of 1"]


def test_a_flavor_no_quota_names_is_not_limited():
    snap = snapshot([node()], team_jobs("acme", 8), quotas=(share("acme", 0, flavor="H100", borrowing_limit=0),))
    assert check(snap, *team_places("acme", 8)) == []


def test_a_cu_quota_counts_each_gpu_at_its_models_rating():
    models = (GpuModelInfo("A100", 1.0), GpuModelInfo("H100", 2.0), GpuModelInfo("Z", 0.0))
    quotas = (share("acme", 4, flavor="CU", borrowing_limit=0), share("globex", 100, flavor="CU"))
    nodes = [node("h", model="H100"), node("z", model="Z"), node("u", model="U")]
    snap = snapshot(nodes, team_jobs("acme", 3), quotas=quotas, gpu_models=models)
    assert check(snap, placed("acme0", on("h", 0), model="H100"), placed("acme1", on("z", 0), model="Z"),
                 placed("acme2", on("u", 0), model="U")) == []
    snap = replace(snap, quotas=(share("acme", 3.5, flavor="CU", borrowing_limit=0.4), share("globex", 100, flavor="CU")))
    assert check(snap, placed("acme0", on("h", 0), model="H100"), placed("acme1", on("z", 0), model="Z"),
                 placed("acme2", on("u", 0), model="U")) == ["team acme: 4 CU is past nominal 3.5 + borrowing limit 0.4"]


def test_a_gpu_counts_once_for_its_model_and_once_in_cu():
    models = (GpuModelInfo("A100", 1.0), GpuModelInfo("H100", 2.0))
    quotas = (share("acme", 1, flavor="H100", borrowing_limit=0), share("acme", 2, flavor="CU", borrowing_limit=0),
              share("globex", 7, flavor="H100"), share("globex", 14, flavor="CU"))
    held = running("old", "h", (7,), tenant="acme", gpu_milli=500, demand=None)
    snap = snapshot([node("h", model="H100")], team_jobs("acme", 1, gpu_milli=500), quotas=quotas,
                    gpu_models=models, running=[held])
    assert check(snap, placed("acme0", on("h", 0, milli=500), model="H100")) == []
    over = replace(snap, running=(replace(held, gpu_milli=600),))
    assert check(over, placed("acme0", on("h", 0, milli=500), model="H100")) == [
        "team acme: 2.2 CU is past nominal 2 + borrowing limit 0",
        "team acme: 1.1 H100 is past nominal 1 + borrowing limit 0"]


def test_a_team_without_a_quota_row_has_nominal_zero_and_no_limit():
    quotas = (share("acme", 8),)
    snap = snapshot([node()], team_jobs("globex", 2) + team_jobs("initech", 1, preemptible=False), quotas=quotas)
    assert check(snap, *team_places("globex", 2), pending={"initech0": waiting()}) == []
    assert check(snap, *team_places("globex", 2), *team_places("initech", 1, start=2)) == [
        "team initech: jobs that cannot be preempted borrow A100"]


# ----------------------------------------------------------------------------- found by mutation testing (issue 9)


def test_a_gang_whose_gpus_do_not_split_evenly_over_its_nodes_is_refused():
    # 3 GPUs over 2 nodes: 1 + 1 is a GPU short, 2 + 1 is not a gang. The engine never places it (INVALID_DEMAND).
    fast = [node("a", fast_fabric=True), node("b", fast_fabric=True)]
    snap = snapshot(fast, [job("g", gpus=3, nodes=2)])
    assert check(snap, placed("g", on("a", 0), on("b", 0))) == ["g: 3 GPUs do not split evenly over 2 nodes"]


def test_every_placement_is_checked_after_one_of_a_job_that_is_not_pending():
    snap = snapshot([node(used={0: 1000})], [job("j")])
    assert check(snap, placed("ghost", on("a", 1)), placed("j", on("a", 0))) == [
        "ghost: placed but not pending", "j: GPU 0 on a over-allocated"]


def test_every_part_and_gpu_is_checked_after_one_that_is_missing():
    snap = snapshot([node("a", used={0: 1000}, fast_fabric=True)], [job("g", gpus=2, nodes=2), job("j", gpus=2)])
    assert check(snap, placed("g", on("zz", 1), on("a", 0)), placed("j", on("a", 9, 0))) == [
        "g: multi-node gang without a fast fabric", "g: unknown node or launch zz", "g: GPU 0 on a over-allocated",
        "j: no GPU 9 on a", "j: GPU 0 on a over-allocated"]


def test_a_gang_with_a_part_on_a_node_and_a_part_nowhere_is_spread():
    snap = snapshot([node("a", fast_fabric=True)], [job("g", gpus=2, nodes=2)])
    assert check(snap, placed("g", on("a", 0), PlacementPart(gpu_indices=(1,)))) == [
        "g: gang spread over owned nodes and launches", "g: multi-node gang without a fast fabric",
        "g: unknown node or launch ?"]


def test_a_tenants_gpu_quota_counts_the_gpus_of_the_model_the_job_got():
    # 4 CU on H100s (2 CU each) is 2 GPUs; 8 L4s or 1 H100 by gpus_by_model.
    snap = snapshot([node("h", model="H100")],
                    [job("cu", gpus=0, compute_units=4.0), job("alt", gpus=1, gpus_by_model=(("L4", 8), ("H100", 1)))],
                    tenants=[budget(gpu_quota=3.0)])
    assert check(snap, placed("cu", on("h", 0, 1), model="H100"), placed("alt", on("h", 2), model="H100")) == []
    snap = replace(snap, tenants=(budget(gpu_quota=2.9),))
    assert check(snap, placed("cu", on("h", 0, 1), model="H100"), placed("alt", on("h", 2), model="H100")) == [
        "tenant acme: GPU quota exceeded"]


def test_a_plan_at_a_limit_plus_the_allowance_for_float_noise_is_within_it():
    # Every limit allows 1e-6 more than it says, so that sums of fractions never read as a violation; a
    # plan exactly at that allowance is within the limit (the tests above cover one step past it).
    tenant = budget(gpu_quota=1.0, gpus_in_use=1e-6, cu_quota=1.0, cu_in_use=1e-6, remaining_budget=1.0)
    snap = snapshot([node()], [job("p", max_price_per_hour=2.0, tenant="globex"), job("g")], tenants=[tenant])
    assert check(snap, placed("p", on("a", 0), price=2.0 + 1e-6), placed("g", on("a", 1), price=1.0 + 1e-6)) == []
    # Quotas of shared capacity: one GPU rated 1 + 1e-6 CU against a nominal of 1 CU, no borrowing, a
    # pool of 1 (globex keeps all of its 100), for a job that cannot be preempted.
    models = (GpuModelInfo("R", 1.0 + 1e-6),)
    quotas = (share("acme", 1.0, flavor="CU", borrowing_limit=0.0), share("globex", 100.0, flavor="CU", lending_limit=0))
    snap = snapshot([node(model="R")], [job("j", preemptible=False)], quotas=quotas, gpu_models=models)
    assert check(snap, placed("j", on("a", 0), model="R")) == []


def test_every_move_and_gpu_is_checked_after_one_that_is_wrong():
    snap = snapshot(two_nodes(used={0: 1000}), running=[running(), running("s", "a", (2, 3))])
    assert moves(snap, move("zz"), move(to="zz"), move("s", gpus=(9, 0))) == [
        "zz: moved but not running", "r: unknown node zz", "s: no GPU 9 on b", "s: GPU 0 on b over-allocated or unhealthy"]


def test_a_move_may_land_on_a_model_the_job_allows():
    snap = snapshot(two_nodes(), running=[running(demand=job("r", gpus=2, allowed_models=("H100", "A100")))])
    assert moves(snap, move()) == []


def test_a_move_onto_a_launch_is_refused_and_one_from_a_node_now_gone_is_not():
    # Moves go to owned nodes; a job whose node left the snapshot may still move to one.
    snap = snapshot(two_nodes(), running=[running()], offers=[offer("o")])
    to_launch = Migration(job_id="r", from_node_id="a", to=PlacementPart((0, 1), launch_id="L1"), reason="cheaper")
    assert plan_violations(snap, Plan(migrations=(to_launch,), launches=(launch(),))) == [
        "r: move from a to None does not leave a"]
    gone = snapshot([node("b")], running=[running(node_id="gone")])
    assert moves(gone, move(source="gone")) == []


def test_a_cu_quota_counts_a_gpu_rated_below_one_at_its_rating():
    models = (GpuModelInfo("A100", 1.0), GpuModelInfo("T4", 0.25))
    quotas = (share("acme", 0.5, flavor="CU", borrowing_limit=0), share("globex", 100, flavor="CU"))
    snap = snapshot([node("t", model="T4")], team_jobs("acme", 3), quotas=quotas, gpu_models=models)
    assert check(snap, *team_places("acme", 2, "t"), pending={"acme2": waiting()}) == []
    assert check(snap, *team_places("acme", 3, "t")) == ["team acme: 0.75 CU is past nominal 0.5 + borrowing limit 0"]


def test_a_node_with_two_gpu_models_counts_each_gpu_as_its_own_model():
    mixed = node("m")
    mixed = replace(mixed, gpus=tuple(replace(g, model="H100") if g.index >= 4 else g for g in mixed.gpus))
    quotas = (share("acme", 0, flavor="A100", borrowing_limit=0), share("acme", 4, flavor="H100"))
    snap = snapshot([mixed], team_jobs("acme", 2), quotas=quotas)
    assert check(snap, placed("acme0", on("m", 4), model="H100"), placed("acme1", on("m", 5), model="H100")) == []
    assert check(snap, placed("acme0", on("m", 4), model="H100"), placed("acme1", on("m", 0))) == [
        "team acme: 1 A100 is past nominal 0 + borrowing limit 0"]


def test_use_on_rented_nodes_and_nodes_gone_from_the_snapshot_is_not_use_of_the_cohort():
    quotas = (share("acme", 1, borrowing_limit=0),)
    held = [running("r", "rented", (0,), tenant="acme", demand=None), running("g", "gone", (0,), tenant="acme", demand=None)]
    snap = snapshot([node("a"), node("rented", rented=True)], team_jobs("acme", 1), quotas=quotas, running=held)
    assert check(snap, placed("acme0", on("a", 0))) == []


def test_a_gpu_counts_as_at_most_one_gpu_whatever_share_a_row_says():
    quotas = (share("acme", 2, borrowing_limit=0),)
    snap = snapshot([node()], team_jobs("acme", 1, gpu_milli=1001), quotas=quotas,
                    running=[running("old", "a", (7,), tenant="acme", gpu_milli=1001, demand=None)])
    assert check(snap, placed("acme0", on("a", 0, milli=1001))) == ["acme0: GPU 0 on a over-allocated"]


def test_quotas_are_checked_for_every_placement_and_part_after_one_that_does_not_count():
    quotas = (share("acme", 0, borrowing_limit=0),)
    nodes = [node("rented", rented=True, fast_fabric=True), node("a", fast_fabric=True)]
    snap = snapshot(nodes, [job("g", gpus=2, nodes=2)], quotas=quotas)
    assert check(snap, placed("ghost", on("a", 7)), placed("g", on("rented", 0), on("a", 0))) == [
        "ghost: placed but not pending", "team acme: 1 A100 is past nominal 0 + borrowing limit 0"]


def test_a_team_without_a_quota_row_keeps_no_reserve_from_the_pool():
    # acme keeps all of its 4: the pool is the 4 no quota names; globex (no row) may use 4, not 5.
    quotas = (share("acme", 4, lending_limit=0),)
    snap = snapshot([node()], team_jobs("globex", 5), quotas=quotas)
    assert check(snap, *team_places("globex", 4), pending={"globex4": waiting()}) == []
    assert check(snap, *team_places("globex", 5)) == ["flavor A100: teams use 5 of the cohort's pool of 4"]


def test_use_inside_a_reserve_before_the_plan_does_not_excuse_going_past_the_pool():
    # globex runs 6 of the 7 it keeps; the pool is acme's 1: acme adding 2 goes past it.
    quotas = (share("acme", 1), share("globex", 7, lending_limit=0))
    held = running("g", "a", (2, 3, 4, 5, 6, 7), tenant="globex", demand=None)
    snap = snapshot([node()], team_jobs("acme", 2), quotas=quotas, running=[held])
    assert check(snap, *team_places("acme", 2)) == ["flavor A100: teams use 2 of the cohort's pool of 1"]
