"""Catalog loading: small CSVs with every quirk, the real excerpts, and the shipped catalog."""
from __future__ import annotations

from pathlib import Path

import pytest

from providers.catalog import load_catalog_csv, load_default_catalog
from providers.catalog.loader import detect_provider

EXCERPTS = Path("/work/shared/data/catalog-excerpts")
AWS_HEADER = "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone,Arch"
GCP_HEADER = "InstanceType,vCPUs,MemoryGiB,AcceleratorName,AcceleratorCount,GpuInfo,Region,AvailabilityZone,Price,SpotPrice"
A100_INFO = "\"{'Gpus': [{'Name': 'A100', 'Count': 8, 'MemoryInfo': {'SizeInMiB': 40960}}]}\""


def write(tmp_path: Path, name: str, header: str, rows: list[str]) -> Path:
    path = tmp_path / name
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def test_aws_quirks(tmp_path: Path) -> None:
    path = write(tmp_path, "aws.csv", AWS_HEADER, [
        f"p4d.24xlarge,A100,8.0,96.0,1152.0,{A100_INFO},21.957642,2.4655,us-east-1,use1-az1,x86_64",
        "p3.2xlarge,V100,1.0,8.0,61.0,,3.06,,us-east-1,use1-az3,x86_64",  # empty spot
        "p5.48xlarge,H100,8.0,192.0,2048.0,,55.04,55.04,us-east-1,use1-az1,x86_64",  # spot == on-demand
        "p5.48xlarge,H100,8.0,192.0,2048.0,,55.04,60.0,us-east-1,use1-az2,x86_64",  # spot > on-demand
        "g6.xlarge,L4,1.0,4.0,16.0,,,0.4,us-east-1,use1-az1,x86_64",  # no price
        "p5.48xlarge,H100,8.0,192.0,2048.0,,9999.0,9999.0,sa-east-1,sae1-az1,x86_64",  # placeholder
        "g5.xlarge,A10G,1.0,4.0,16.0,,0.0,,us-east-1,use1-az1,x86_64",  # zero: placeholder
        "a1.2xlarge,,,8.0,16.0,,0.204,0.204,us-east-1,use1-az2,arm64",  # not a GPU type
    ])
    load = load_catalog_csv(path)
    by_key = {(o.instance_type, o.zone): o for o in load.offers}
    assert set(by_key) == {("p4d.24xlarge", "use1-az1"), ("p3.2xlarge", "use1-az3"), ("p5.48xlarge", "use1-az1"),
                           ("p5.48xlarge", "use1-az2")}
    p4d = by_key[("p4d.24xlarge", "use1-az1")]
    assert (p4d.on_demand_per_hour, p4d.spot_per_hour, p4d.gpu_count, p4d.gpu_memory_mib) == (21.957642, 2.4655, 8, 40960)
    assert p4d.fabric == ("efa", "nvlink")
    assert by_key[("p3.2xlarge", "use1-az3")].spot_per_hour is None
    assert by_key[("p3.2xlarge", "use1-az3")].gpu_memory_mib == 16384  # fallback when GpuInfo is empty
    assert by_key[("p5.48xlarge", "use1-az1")].spot_per_hour is None
    assert by_key[("p5.48xlarge", "use1-az2")].spot_per_hour is None
    assert load.skipped == {"spot_not_below_on_demand": 2, "no_price": 1, "placeholder_price": 2, "not_gpu": 1}
    assert len(load.warnings) == 5


def test_gcp_host_and_accelerator_rows_are_summed(tmp_path: Path) -> None:
    path = write(tmp_path, "gcp.csv", GCP_HEADER, [
        "a2-highgpu-1g,12.0,85.0,,,,us-central1,us-central1-a,0.73948,0.36975",
        "a2-highgpu-8g,96.0,680.0,,,,us-central1,us-central1-a,5.91582,",  # host without spot
        "n1-standard-8,8.0,30.0,,,,us-central1,us-central1-a,0.379998,0.08",
        "g2-standard-4,4.0,16.0,,,,us-central1,us-central1-b,0.14679,",  # no L4 row in that zone
        "e2-standard-4,4.0,16.0,,,,us-central1,us-central1-a,0.134,0.04",  # no GPUs at all
        ",,,A100,2,{'Gpus': [{'MemoryInfo': {'SizeInMiB': 40960}}]},us-central1,us-central1-a,5.86782,2.8682",
        ",,,T4,1,{'Gpus': [{'MemoryInfo': {'SizeInMiB': 16384}}]},us-central1,us-central1-a,0.35,0.175",
        ",,,A100-80GB,1,,us-central1,us-central1-a,1.8462,1.964",  # spot above on-demand
        ",,,H100,8,,asia-south2,asia-south2-a,700.0,700.0",  # placeholder
        ",,,V100,1,,us-central1,us-central1-a,,",  # no price
        ",,,tpu-v3-8,1,tpu-v3-8,us-east1,us-east1-d,8.0,",  # TPU: not a GPU
    ])
    load = load_catalog_csv(path)
    offers = {(o.instance_type, o.gpu_model, o.gpu_count): o for o in load.offers}
    a2 = offers[("a2-highgpu-1g", "A100", 1)]
    # The design note's worked example: host $0.73948 + A100 $5.86782/2 = $3.673/h.
    assert a2.on_demand_per_hour == pytest.approx(0.73948 + 5.86782 / 2, abs=1e-5)
    assert a2.spot_per_hour == pytest.approx(0.36975 + 2.8682 / 2, abs=1e-5)
    assert a2.gpu_memory_mib == 40960
    a2_8 = offers[("a2-highgpu-8g", "A100", 8)]
    assert a2_8.on_demand_per_hour == pytest.approx(5.91582 + 8 * 5.86782 / 2, abs=1e-5)
    assert a2_8.spot_per_hour is None and a2_8.fabric == ("nvlink",)
    # N1 takes T4 in the counts GCP allows for 8 vCPUs; no V100 (its row had no price).
    assert {k for k in offers if k[0] == "n1-standard-8"} == {("n1-standard-8", "T4", n) for n in (1, 2, 4)}
    assert offers[("n1-standard-8", "T4", 4)].on_demand_per_hour == pytest.approx(0.379998 + 4 * 0.35, abs=1e-5)
    assert not any(k[0] in ("g2-standard-4", "e2-standard-4") for k in offers)
    assert load.skipped["placeholder_price"] == 1
    assert load.skipped["no_price"] == 1
    assert load.skipped["spot_not_below_on_demand"] == 1
    assert load.skipped["no_gpu_price"] == 1  # g2 in a zone without an L4 row


def test_ultragpu_spot_dropped_when_gpu_spot_is_not_cheaper(tmp_path: Path) -> None:
    path = write(tmp_path, "gcp.csv", GCP_HEADER, [
        "a2-ultragpu-1g,12.0,170.0,,,,us-central1,us-central1-a,1.09962,0.54978",
        ",,,A100-80GB,1,,us-central1,us-central1-a,1.8462,1.964",
    ])
    [offer] = load_catalog_csv(path).offers
    assert offer.on_demand_per_hour == pytest.approx(1.09962 + 1.8462)
    assert offer.spot_per_hour is None


def test_real_excerpts_load() -> None:
    aws = load_catalog_csv(EXCERPTS / "aws_vms_v8_gpu_excerpt.csv")
    gcp = load_catalog_csv(EXCERPTS / "gcp_vms_v8_gpu_excerpt.csv")
    p4d = [o for o in aws.offers if o.instance_type == "p4d.24xlarge" and o.zone == "use1-az1"]
    assert p4d and p4d[0].on_demand_per_hour == 21.957642
    a2 = [o for o in gcp.offers if o.instance_type == "a2-highgpu-1g"]
    assert a2 and a2[0].on_demand_per_hour == pytest.approx(3.67339, abs=1e-5)
    assert aws.skipped["spot_not_below_on_demand"] == 1  # p5.48xlarge use1-az1 at 55.04/55.04
    assert not any(o.gpu_model.startswith("tpu") for o in gcp.offers)


def test_detect_provider(tmp_path: Path) -> None:
    assert detect_provider(write(tmp_path, "a.csv", AWS_HEADER, [])) == "aws"
    assert detect_provider(write(tmp_path, "g.csv", GCP_HEADER, [])) == "gcp"
    with pytest.raises(ValueError):
        detect_provider(write(tmp_path, "x.csv", "Foo,Bar", []))


def test_shipped_catalog_covers_main_gpu_families() -> None:
    load = load_default_catalog()
    aws_types = {o.instance_type for o in load.offers if o.provider == "aws"}
    for family in ("p5.", "p4d.", "p4de.", "p3.", "g6.", "g6e.", "g5.", "g4dn."):
        assert any(t.startswith(family) for t in aws_types), family
    gcp = {(o.instance_type, o.gpu_model) for o in load.offers if o.provider == "gcp"}
    for prefix, gpu in (("a3-highgpu", "H100"), ("a2-highgpu", "A100"), ("a2-ultragpu", "A100-80GB"),
                        ("g2-standard", "L4"), ("n1-", "T4"), ("n1-", "V100")):
        assert any(t.startswith(prefix) and g == gpu for t, g in gcp), (prefix, gpu)
    for offer in load.offers:
        assert offer.on_demand_per_hour > 0 and offer.gpu_count > 0 and offer.gpu_memory_mib > 0
        assert offer.spot_per_hour is None or offer.spot_per_hour < offer.on_demand_per_hour
    # Known list prices survive the load unchanged.
    prices = {(o.instance_type, o.region, o.zone): o.on_demand_per_hour for o in load.offers if o.provider == "aws"}
    assert prices[("p5.48xlarge", "us-east-1", "use1-az2")] == 55.04
    assert prices[("g4dn.xlarge", "us-east-1", "")] == 0.526
    assert not load.skipped["no_price"] and not load.skipped["placeholder_price"]
