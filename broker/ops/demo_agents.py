"""Start a node agent with fake GPUs for every simulated on-prem node, through the `local` provider.

This is how `make run` gets a working cluster on a laptop: the seeded nodes become live machines
that register, heartbeat and run their jobs' processes.
"""
from __future__ import annotations

import sys
from pathlib import Path

from django.conf import settings

from broker.inventory.models import Node, Pool, PoolKind
from broker.inventory.services import pool_join_token_issue
from providers.base import InstanceRef, ProvisionRequest, derive_request_key
from providers.local.provider import LocalProvider, LocalShape, agent_command

# Our catalogue names -> the fake NVML model names the agent simulates.
FAKE_MODEL = {
    "A100-80GB": "A100-80GB-SXM", "A100-40GB": "A100-40GB-SXM", "H100-80GB": "H100-80GB-SXM",
    "H200-141GB": "H200-141GB-SXM", "V100-32GB": "V100-32GB-SXM2", "V100-16GB": "V100-16GB-SXM2",
    "T4": "T4", "L4": "L4", "L40S": "L40S", "A10G": "A10G",
}


def fake_spec(node: Node) -> str | None:
    gpus = list(node.gpus.all())
    if not gpus:
        return None
    model = gpus[0].model.name if gpus[0].model else gpus[0].model_name
    fake = FAKE_MODEL.get(model)
    return f"{len(gpus)}x{fake}" if fake else None


def demo_provider(pool: Pool) -> LocalProvider:
    state_dir = Path(settings.VAR_DIR) / "demo-agents" / f"pool-{pool.pk}"
    return LocalProvider(broker_id=f"{settings.WHALEZEN_BROKER_ID}-onprem-demo", state_dir=state_dir,
                         command_factory=agent_command(sys.executable, state_root=state_dir / "agents"),
                         region=pool.region or "local")


def start_demo_agents(*, server_url: str) -> list[tuple[LocalProvider, InstanceRef]]:
    """One agent per simulated node of each on-prem pool; returns what to stop at exit."""
    started = []
    for pool in Pool.objects.filter(kind=PoolKind.ONPREM, enabled=True):
        nodes = [n for n in pool.nodes.prefetch_related("gpus__model") if n.labels.get("simulated") == "true"]
        if not nodes:
            continue
        join_token = pool_join_token_issue(pool=pool)
        shapes = []
        for node in nodes:
            spec = fake_spec(node)
            if spec:
                shapes.append((node, LocalShape(instance_type=f"sim-{node.name}", fake_gpus=spec, gpu_model="",
                                                gpu_count=node.gpus.count(), gpu_memory_mib=0, vcpus=0, memory_gib=0)))
        provider = demo_provider(pool)
        provider.shapes = {shape.instance_type: shape for _, shape in shapes}
        for stale in provider.list_owned():  # agents left by a previous run that was killed
            provider.terminate(stale.ref)
        for node, shape in shapes:
            key = derive_request_key(allocation_id=f"demo-{node.pk}", attempt=1, provider="local",
                                     instance_type=shape.instance_type, zone=provider.zones[0])
            info = provider.provision(ProvisionRequest(
                request_key=key, allocation_id=f"demo-{node.pk}", attempt=1, region=provider.region,
                zone=provider.zones[0], instance_type=shape.instance_type, agent_server_url=server_url,
                agent_join_token=join_token, node_name=node.name))
            started.append((provider, info.ref))
    return started


def stop_simulated_cloud(*, log) -> int:
    """Terminate the `local` pools' simulated instances: on a laptop they are processes that should
    not outlive the service (a real cloud's instances are left to the reconciler instead)."""
    from broker.inventory.models import CloudInstance, InstanceState
    from broker.provisioning.services import instance_terminate

    stopped = 0
    live = (InstanceState.REQUESTED, InstanceState.PENDING, InstanceState.RUNNING, InstanceState.TERMINATING)
    for instance in CloudInstance.objects.filter(pool__kind=PoolKind.LOCAL, state__in=live).select_related("pool"):
        try:
            instance_terminate(instance=instance, reason="service stopped")
            stopped += 1
        except Exception as exc:  # keep stopping the others
            log(f"stopping simulated instance {instance.node_name}: {exc}")
    return stopped
