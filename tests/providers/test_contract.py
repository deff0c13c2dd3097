"""The contract itself: keys, errors, registry, boot script, on-prem, and the no-Django rule."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from providers import (
    ErrorKind,
    InstanceRef,
    InstanceState,
    Provider,
    ProviderError,
    build_provider,
    derive_request_key,
    provider_class,
    provider_kinds,
)
from providers.bootstrap import agent_boot_script
from providers.onprem import OnPremNode, OnPremProvider, PoolRates
from tests.providers.conftest import BROKER_ID, make_request

REPO = Path(__file__).resolve().parents[2]


def test_request_key_is_stable_safe_and_distinct() -> None:
    key = derive_request_key(allocation_id="Alloc_42/x", attempt=2, provider="gcp", instance_type="a2-highgpu-1g",
                             zone="us-central1-a")
    assert key == derive_request_key(allocation_id="Alloc_42/x", attempt=2, provider="gcp",
                                     instance_type="a2-highgpu-1g", zone="us-central1-a")
    assert len(key) <= 63 and key[0].isalpha()
    assert set(key) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
    assert key != derive_request_key(allocation_id="Alloc_42/x", attempt=3, provider="gcp",
                                     instance_type="a2-highgpu-1g", zone="us-central1-a")
    assert key != derive_request_key(allocation_id="Alloc_42/x", attempt=2, provider="aws",
                                     instance_type="a2-highgpu-1g", zone="us-central1-a")


@pytest.mark.parametrize("kind, elsewhere, permanent", [
    (ErrorKind.CAPACITY, True, False), (ErrorKind.QUOTA, True, False), (ErrorKind.AUTH, False, True),
    (ErrorKind.BAD_REQUEST, False, True), (ErrorKind.TRANSIENT, False, False), (ErrorKind.NOT_FOUND, False, True)])
def test_provider_error_defaults(kind: ErrorKind, elsewhere: bool, permanent: bool) -> None:
    error = ProviderError(kind, "x", provider="aws", code="C")
    assert error.retry_elsewhere is elsewhere and error.permanent is permanent
    assert ProviderError(kind, "x", retry_elsewhere=not elsewhere).retry_elsewhere is (not elsewhere)
    assert str(error) == f"aws: {kind.value} [C]: x"


def test_provider_error_survives_pickling() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(ProviderError(ErrorKind.CAPACITY, "no p5", provider="aws",
                                                    code="InsufficientInstanceCapacity", retry_elsewhere=False)))
    assert (error.kind, error.message, error.retry_elsewhere, error.provider, error.code) == (
        ErrorKind.CAPACITY, "no p5", False, "aws", "InsufficientInstanceCapacity")


def test_join_token_not_in_repr() -> None:
    request = make_request(provider="aws", instance_type="p5.48xlarge", zone="us-east-1a", region="us-east-1")
    assert "join-secret-123" not in repr(request)


def test_registry_builds_every_kind() -> None:
    assert provider_kinds() == ["aws", "gcp", "local", "onprem"]
    for kind in provider_kinds():
        cls = provider_class(kind)
        assert issubclass(cls, Provider) and cls.kind == kind
    onprem = build_provider("onprem", broker_id=BROKER_ID)
    assert isinstance(onprem, OnPremProvider)
    with pytest.raises(KeyError):
        provider_class("azure")
    with pytest.raises(ValueError):
        build_provider("onprem", broker_id="")


def test_providers_never_import_django_or_broker() -> None:
    code = ("import sys, providers, providers.aws, providers.gcp, providers.local, providers.onprem, "
            "providers.reconcile, providers.catalog; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'broker', 'rest_framework')); "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stdout + result.stderr


def test_boot_script_runs_agent_and_refuses_injection() -> None:
    script = agent_boot_script(server_url="https://wz.example:8443", join_token="jt-abc", node_name="n1")
    assert "-m agent --server" in script
    # The token in a root-only file the agent reads: neither on its argv nor in its environment.
    assert "\njt-abc\n" in script and "--join-token-file /etc/whalezen/join-token" in script
    assert "WHALEZEN_JOIN_TOKEN" not in script and "systemctl enable --now whalezen-agent" in script
    with pytest.raises(ValueError):
        agent_boot_script(server_url="http://x", join_token="tok\nrm -rf /", node_name="n1")
    with pytest.raises(ValueError):
        agent_boot_script(server_url="http://x", join_token="", node_name="n1")


def test_onprem_offers_priced_from_pool_rates() -> None:
    provider = OnPremProvider(
        broker_id=BROKER_ID,
        nodes=[
            OnPremNode("dgx-01", "lab-a", "A100-80GB", free_gpus=4, gpu_memory_mib=81920, fabric=("nvlink",)),
            OnPremNode("dgx-02", "lab-a", "H100", free_gpus=8, gpu_memory_mib=81920),
            OnPremNode("t4-box", "lab-b", "T4", free_gpus=2, gpu_memory_mib=16384),
            OnPremNode("full", "lab-a", "A100-80GB", free_gpus=0, gpu_memory_mib=81920),
            OnPremNode("sick", "lab-a", "A100-80GB", free_gpus=8, gpu_memory_mib=81920, healthy=False),
        ],
        rates={"lab-a": PoolRates(1.5, per_model=(("H100", 2.5),))},
        default_rate=PoolRates(0.25),
    )
    offers = {o.instance_type: o for o in provider.list_offers()}
    assert set(offers) == {"dgx-01", "dgx-02", "t4-box"}
    assert offers["dgx-01"].on_demand_per_hour == pytest.approx(6.0)
    assert offers["dgx-02"].on_demand_per_hour == pytest.approx(20.0)
    assert offers["t4-box"].on_demand_per_hour == pytest.approx(0.5)
    assert offers["dgx-01"].zone == "lab-a" and offers["dgx-01"].spot_per_hour is None
    assert provider.list_owned() == []
    request = make_request(provider="onprem", instance_type="dgx-01", zone="lab-a", region="onprem")
    with pytest.raises(ProviderError) as caught:
        provider.provision(request)
    assert caught.value.kind is ErrorKind.BAD_REQUEST and "agent" in caught.value.message
    with pytest.raises(ProviderError):
        provider.terminate(InstanceRef(provider="onprem", region="onprem", zone="lab-a", instance_id="dgx-01"))
    ref = InstanceRef(provider="onprem", region="onprem", zone="lab-a", instance_id="dgx-01")
    assert provider.describe(ref).state is InstanceState.RUNNING
    with pytest.raises(ProviderError) as missing:
        provider.describe(InstanceRef(provider="onprem", region="onprem", zone="lab-a", instance_id="nope"))
    assert missing.value.kind is ErrorKind.NOT_FOUND
