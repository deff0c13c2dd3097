"""Adding a Kubernetes cluster as a pool (owned capacity); the bridge's command line refusing what it cannot
use."""
from __future__ import annotations

import stat
import subprocess
import sys
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from broker.billing.services import meter
from broker.inventory.models import Pool, PoolKind
from broker.inventory.services import gpu_model_resolve
from broker.jobs.models import Allocation
from broker.jobs.services import GpuRequest, allocation_commit
from broker.scheduler.services import scheduling_component
from broker.scheduler.snapshot import component_snapshot
from broker.tenancy.models import TeamQuota

from .test_api_tenancy import submit

REPO = Path(__file__).resolve().parents[2]


def test_a_kubernetes_pool_stores_where_the_kubeconfig_is_and_prints_the_bridge_command(acme, tmp_path, capsys):
    token_file = tmp_path / "k8s.token"
    call_command("kubernetes_pool_add", tenant="acme", pool="gpu-k8s", kubeconfig="env:KUBECONFIG", context="prod",
                 namespace="ml-jobs", node_selector=["pool=gpu"], label=["fabric=infiniband"],
                 toleration=['{"key": "dedicated", "operator": "Exists"}'], token_file=token_file,
                 server="http://broker:8000")
    pool = Pool.objects.get(tenant=acme.tenant, name="gpu-k8s")
    assert pool.kind == PoolKind.KUBERNETES
    assert pool.provider_config["kubeconfig"] == "env:KUBECONFIG" and pool.provider_config["namespace"] == "ml-jobs"
    assert pool.provider_config["node_selector"] == {"pool": "gpu"}
    token = token_file.read_text().strip()
    assert token.startswith("wzj_") and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    out = capsys.readouterr().out
    assert "python -m agent kubernetes --server http://broker:8000" in out and "--bridge-id acme-gpu-k8s" in out
    # Every node of the cluster is on one fabric: the bridge labels them so, and gangs may go there.
    assert pool.provider_config["labels"] == {"fabric": "infiniband"} and "--label fabric=infiniband" in out
    assert token not in out  # the token is in the file only


@pytest.mark.parametrize("options, fragment", [
    ({"kubeconfig": "relative/path"}, "an absolute path, env:NAME or in-cluster"),
    ({"node_selector": ["no-equals"]}, "--node-selector"),
    ({"toleration": ["[1, 2]"]}, "--toleration"),
    ({"label": ["fabric"]}, "--label 'fabric': expected KEY=VALUE"),
    ({"label": ["bad key=x"]}, "--label 'bad key=x'"),
    ({"tenant": "nobody"}, "no tenant"),
])
def test_bad_pool_options_are_refused(acme, tmp_path, options, fragment):
    kwargs = {"tenant": "acme", "pool": "k", "kubeconfig": "in-cluster", "token_file": tmp_path / "t", **options}
    with pytest.raises(CommandError, match=fragment):
        call_command("kubernetes_pool_add", **kwargs)
    assert not Pool.objects.filter(name="k").exists()


def test_an_onprem_pool_of_that_name_is_not_turned_into_a_kubernetes_pool(acme, tmp_path):
    with pytest.raises(CommandError, match="is a On-prem pool"):
        call_command("kubernetes_pool_add", tenant="acme", pool="onprem", kubeconfig="in-cluster",
                     token_file=tmp_path / "t")
    assert Pool.objects.get(tenant=acme.tenant, name="onprem").kind == PoolKind.ONPREM


def test_gfd_product_labels_resolve_to_the_catalogue(gpu_models):
    assert gpu_model_resolve("NVIDIA-H100-80GB-HBM3").name == "H100-80GB"
    assert gpu_model_resolve("Tesla-V100-SXM2-16GB").name == "V100-16GB"
    assert gpu_model_resolve("NVIDIA-A100-SXM4-80GB").name == "A100-80GB"
    assert gpu_model_resolve("Tesla-T4").name == "T4"
    assert gpu_model_resolve("NVIDIA-B300-SXM6-AC") is None  # not guessed


@pytest.mark.parametrize("args, fragment", [
    (["--kubeconfig", "/nonexistent/kubeconfig"], "no file at /nonexistent/kubeconfig"),
    (["--kubeconfig", "env:WZ_TEST_UNSET_VAR"], "WZ_TEST_UNSET_VAR is not set"),
    (["--kubeconfig", "in-cluster", "--node-selector", "x"], "expected KEY=VALUE"),
    (["--kubeconfig", "in-cluster", "--toleration", "{bad"], "--toleration"),
    (["--kubeconfig", "in-cluster", "--label", "fabric"], "--label 'fabric': expected KEY=VALUE"),
    (["--kubeconfig", "in-cluster", "--bridge-id", "has space"], "--bridge-id"),
])
def test_the_bridge_refuses_what_it_cannot_use_with_exit_code_2(args, fragment, tmp_path):
    token = tmp_path / "t"
    token.write_text("wzj_x_y\n")
    done = subprocess.run([sys.executable, "-m", "agent", "kubernetes", "--server", "http://127.0.0.1:9",
                           "--join-token-file", str(token), *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, cwd=str(REPO))
    assert done.returncode == 2, done.stderr
    assert fragment in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1  # one line for an operator


def test_a_kubernetes_pool_is_owned_capacity_billed_at_its_chargeback_rate(acme):
    """As the shared-clusters issue prices owned pools: the team is billed the pool's rate per GPU-hour, the
    engine counts the platform's marginal cost (not an instance price), and the GPUs count as owned."""
    Pool.objects.filter(pk=acme.pool.pk).update(kind=PoolKind.KUBERNETES, gpu_hour_rate_usd=Decimal("2.50"),
                                                marginal_cost_usd_per_gpu_hour=Decimal("0.40"))
    nodes = component_snapshot(tenants=scheduling_component(acme.tenant), seed=1, offers=[], launch_limits={}).nodes
    assert {(n.provider, n.rented, n.price_per_gpu_hour) for n in nodes} == {("kubernetes", False, 0.4)}

    TeamQuota.objects.create(tenant=acme.tenant, flavor="A100-80GB", nominal=Decimal("1"))
    job = submit(acme, resources={"gpus": 2})
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0, 1))])
    now = timezone.now()
    start = max(now - timedelta(hours=2), now.replace(day=1, hour=0, minute=0, second=0, microsecond=0))
    Allocation.objects.filter(job=job).update(created_at=start)
    meter(now=now)
    held_h = Decimal(int(now.timestamp()) - int(start.timestamp())) / 3600
    spent = Decimal(acme.client.get("/api/v1/budget/").json()["spent_usd"])
    expected = (2 * held_h * Decimal("2.50")).quantize(Decimal("0.01"))
    assert spent == pytest.approx(expected, abs=Decimal("0.02"))
    # Fair share counts it as the team's use of owned capacity (rented capacity is paid for, not shared).
    quotas = {row["flavor"]: row for row in acme.client.get("/api/v1/quota/").json()["quotas"]}
    assert quotas["A100-80GB"]["in_use"] == 2 and quotas["A100-80GB"]["borrowed"] == 1
