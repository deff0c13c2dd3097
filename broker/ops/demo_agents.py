"""Start a node agent with fake GPUs for every demo on-prem node, through the `local` provider.

This is how `make run` gets a working cluster on a laptop: the seeded nodes become live machines
that register, heartbeat and run their jobs' processes. Which nodes are demo nodes, and which fake
GPUs they get, is recorded by `seed_demo` in their pool's `provider_config["demo_nodes"]`: a node's
own labels and GPUs belong to its agent once it registers, so they cannot say it is a demo node.
"""
from __future__ import annotations

import sys
from pathlib import Path

from django.conf import settings

from broker.inventory.models import Pool, PoolKind
from broker.inventory.services import pool_join_token_issue
from providers.base import InstanceRef, ProvisionRequest, derive_request_key
from providers.base import InstanceState as ProviderState
from providers.local.provider import LocalProvider, LocalShape, agent_command

# Our catalogue names -> the fake NVML model names the agent simulates.
FAKE_MODEL = {
    "A100-80GB": "A100-80GB-SXM", "A100-40GB": "A100-40GB-SXM", "H100-80GB": "H100-80GB-SXM",
    "H200-141GB": "H200-141GB-SXM", "V100-32GB": "V100-32GB-SXM2", "V100-16GB": "V100-16GB-SXM2",
    "T4": "T4", "L4": "L4", "L40S": "L40S", "A10G": "A10G",
}


# The key of an on-prem pool's provider_config that lists its demo nodes: {node name: --fake-gpus spec}.
DEMO_NODES_KEY = "demo_nodes"


def fake_spec(model_name: str, gpu_count: int) -> str | None:
    """The agent's --fake-gpus spec for `gpu_count` GPUs of a catalogue model (None if not simulated)."""
    fake = FAKE_MODEL.get(model_name)
    return f"{gpu_count}x{fake}" if fake and gpu_count > 0 else None


def demo_nodes(pool: Pool) -> dict[str, str]:
    """The pool's demo nodes as recorded by seed_demo: node name -> fake GPU spec."""
    recorded = (pool.provider_config or {}).get(DEMO_NODES_KEY)
    if not isinstance(recorded, dict):
        return {}
    return {str(name): str(spec) for name, spec in recorded.items() if isinstance(spec, str) and "x" in spec}


def demo_provider(pool: Pool) -> LocalProvider:
    state_dir = Path(settings.VAR_DIR) / "demo-agents" / f"pool-{pool.pk}"
    return LocalProvider(broker_id=f"{settings.WHALEZEN_BROKER_ID}-onprem-demo", state_dir=state_dir,
                         command_factory=agent_command(sys.executable, state_root=state_dir / "agents"),
                         region=pool.region or "local")


def stop_demo_agents(*, log, reason: str = "left by a previous run") -> int:
    """Terminate every demo agent a previous run left running (it may have been SIGKILLed, so its
    own cleanup never ran), then forget the terminated ones: a demo agent's request key is the same
    every run, and a remembered terminated instance would be returned instead of a new one."""
    stopped = 0
    for pool in Pool.objects.filter(kind=PoolKind.ONPREM):
        if not (Path(settings.VAR_DIR) / "demo-agents" / f"pool-{pool.pk}").exists():
            continue
        provider = demo_provider(pool)
        for info in provider.list_owned():
            if info.state is not ProviderState.TERMINATED:
                result = provider.terminate(info.ref, reason=reason)
                log(f"stopped demo agent {info.ref.instance_id} {reason} ({result.state.value})")
                stopped += 1
        provider.prune(older_than_s=0)
    return stopped


def start_demo_agents(*, server_url: str, log=lambda message: None) -> list[tuple[LocalProvider, InstanceRef]]:
    """One agent per demo node of each on-prem pool; returns what to stop at exit."""
    stop_demo_agents(log=log)
    started = []
    for pool in Pool.objects.filter(kind=PoolKind.ONPREM, enabled=True):
        wanted = demo_nodes(pool)
        nodes = list(pool.nodes.filter(name__in=wanted).order_by("name"))
        if not nodes:
            continue
        join_token = pool_join_token_issue(pool=pool)
        shapes = []
        for node in nodes:
            spec = wanted[node.name]
            count = spec.split("x", 1)[0]
            # The demo's SXM nodes sit on InfiniBand, as such clusters do: multi-node jobs can run there.
            fabric = ("infiniband",) if "-SXM" in spec else ()
            shapes.append((node, LocalShape(instance_type=f"sim-{node.name}", fake_gpus=spec, gpu_model="",
                                            gpu_count=int(count) if count.isdecimal() else 0, gpu_memory_mib=0,
                                            vcpus=0, memory_gib=0, fabric=fabric)))
        provider = demo_provider(pool)
        provider.shapes = {shape.instance_type: shape for _, shape in shapes}
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
    not outlive the service (a real cloud's instances are left to the reconciler instead). First the
    recorded ones (their jobs requeue), then whatever the provider still runs that no record knows
    (an agent a killed worker started before it could record it)."""
    from broker.inventory.models import CloudInstance, InstanceState
    from broker.provisioning.factory import provider_for_pool
    from broker.provisioning.services import instance_terminate

    stopped = 0
    live = (InstanceState.REQUESTED, InstanceState.PENDING, InstanceState.RUNNING, InstanceState.TERMINATING)
    for instance in CloudInstance.objects.filter(pool__kind=PoolKind.LOCAL, state__in=live).select_related("pool"):
        try:
            instance_terminate(instance=instance, reason="service stopped")
            stopped += 1
        except Exception as exc:  # keep stopping the others
            log(f"stopping simulated instance {instance.node_name}: {exc}")
    for pool in Pool.objects.filter(kind=PoolKind.LOCAL):
        provider = provider_for_pool(pool)
        for info in provider.list_owned():
            if info.state is not ProviderState.TERMINATED:
                provider.terminate(info.ref, reason="service stopped")
                log(f"stopped unrecorded simulated instance {info.ref.instance_id}")
                stopped += 1
    return stopped
