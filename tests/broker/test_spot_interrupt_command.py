"""`manage.py spot_interrupt`: the demo's way to reclaim a simulated spot instance as a cloud would.

That the notice is then served by the instance's metadata endpoint and reaches the broker through a real
agent is tested in tests/providers/test_local_spot.py."""
from __future__ import annotations

import io
import sys

import pytest
from django.core.management import CommandError, call_command

from broker.inventory.models import CloudInstance, InstanceState as RowState, Pool, PoolKind
from broker.provisioning.factory import provider_for_pool
from providers.base import InstanceState, ProvisionRequest


def test_the_instance_is_taken_when_the_notice_runs_out(acme, settings, tmp_path):
    settings.VAR_DIR = tmp_path
    pool = Pool.objects.create(tenant=acme.tenant, name="cloud-sim", kind=PoolKind.LOCAL, region="sim",
                               max_instances=2)
    provider = provider_for_pool(pool)
    provider.command_factory = lambda request, name, shape: [sys.executable, "-c", "import time; time.sleep(300)"]
    shape = next(iter(provider.shapes))
    info = provider.provision(ProvisionRequest(
        request_key="k1", allocation_id="k1", attempt=1, region=provider.region, zone=provider.zones[0],
        instance_type=shape, agent_server_url="http://127.0.0.1:9", agent_join_token="wzi_x", node_name="sim-1",
        extra_tags=(("whalezen:pool", str(pool.pk)),)))
    CloudInstance.objects.create(tenant=acme.tenant, pool=pool, request_key="k1", provider_id=info.ref.instance_id,
                                 instance_type=shape, zone=provider.zones[0], state=RowState.RUNNING,
                                 node_name="sim-1", offer={"region": provider.region})
    try:
        out = io.StringIO()
        call_command("spot_interrupt", "sim-1", "--in", "60", stdout=out)
        assert "spot notice posted" in out.getvalue() and "60 s" in out.getvalue()
        fresh = provider_for_pool(pool)
        assert fresh.describe(info.ref).state is InstanceState.RUNNING  # taken only when the time is up
        call_command("spot_interrupt", "sim-1", "--in", "1", stdout=io.StringIO())
        import time

        deadline = time.time() + 20
        while fresh.describe(info.ref).state is not InstanceState.TERMINATED and time.time() < deadline:
            time.sleep(0.5)
        assert fresh.describe(info.ref).state is InstanceState.TERMINATED
    finally:
        provider.terminate(info.ref)


def test_unknown_nodes_and_real_clouds_are_refused(acme):
    with pytest.raises(CommandError, match="No live cloud instance"):
        call_command("spot_interrupt", "nope")
    pool = Pool.objects.create(tenant=acme.tenant, name="aws-east", kind=PoolKind.AWS, region="us-east-1")
    CloudInstance.objects.create(tenant=acme.tenant, pool=pool, request_key="k2", provider_id="i-1",
                                 instance_type="p4d.24xlarge", zone="us-east-1a", state=RowState.RUNNING,
                                 node_name="aws-1")
    with pytest.raises(CommandError, match="real clouds send their own"):
        call_command("spot_interrupt", "aws-1")
    with pytest.raises(CommandError, match="between 1 and 3600"):
        call_command("spot_interrupt", "aws-1", "--in", "0")
