"""The plan validator refuses a multi-node gang without a fast fabric, on owned nodes and on launches,
and a part that names a launch the plan does not have (hand-written plans: the engine never makes them)."""

from __future__ import annotations

from engine_factories import gpu_node, job, offer, snapshot
from scheduling.model import Launch, Placement, PlacementPart, Plan
from scheduling.validate import plan_violations


def gang_on_nodes(*node_ids: str) -> Plan:
    parts = tuple(PlacementPart(gpu_indices=tuple(range(8)), node_id=n) for n in node_ids)
    return Plan(placements=(Placement(job_id="g", parts=parts, gpu_model="A100"),))


def test_a_gang_across_nodes_without_a_fast_fabric_is_refused():
    nodes = [gpu_node("a"), gpu_node("b")]
    snap = snapshot(nodes, [job("g", gpus=16, nodes=2)])
    assert "g: multi-node gang without a fast fabric" in plan_violations(snap, gang_on_nodes("a", "b"))
    fast = snapshot([gpu_node("a", fast_fabric=True), gpu_node("b", fast_fabric=True)], [job("g", gpus=16, nodes=2)])
    assert not [p for p in plan_violations(fast, gang_on_nodes("a", "b")) if "fabric" in p]


def gang_on_launch(offer_id: str, launch_id: str = "L1", listed: bool = True) -> Plan:
    parts = tuple(PlacementPart(gpu_indices=tuple(range(8)), launch_id=launch_id, instance=i) for i in range(2))
    launches = (Launch(launch_id="L1", offer_id=offer_id, count=2, spot=False, job_ids=("g",),
                       price_per_hour=32.0),) if listed else ()
    return Plan(placements=(Placement(job_id="g", parts=parts, gpu_model="A100"),), launches=launches)


def test_a_gang_on_instances_of_an_offer_without_a_fast_fabric_is_refused():
    slow = snapshot([], [job("g", gpus=16, nodes=2)], [offer("o", fast_fabric=False)])
    assert "g: multi-node gang without a fast fabric" in plan_violations(slow, gang_on_launch("o"))
    fast = snapshot([], [job("g", gpus=16, nodes=2)], [offer("o", fast_fabric=True)])
    assert not [p for p in plan_violations(fast, gang_on_launch("o")) if "fabric" in p]


def test_a_part_on_a_launch_the_plan_lacks_is_a_violation_not_a_crash():
    snap = snapshot([], [job("g", gpus=16, nodes=2)], [offer("o", fast_fabric=True)])
    problems = plan_violations(snap, gang_on_launch("o", listed=False))
    assert "g: multi-node gang without a fast fabric" in problems
