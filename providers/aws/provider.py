"""AWS EC2 provider (boto3).

Idempotency has two layers: the EC2 `ClientToken` (the request key, stored by the broker before
the call; EC2 returns the same instance for the same token), and a lookup of instances already
tagged with the request key before every create (moto ignores ClientToken, and a real token only
lives for a while). Every instance, volume, network interface and spot request is tagged at
creation, so nothing we start is ever invisible to the reconciler.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Sequence

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from providers.aws.client import make_ec2_client
from providers.aws.errors import map_boto_error, map_client_error
from providers.base import (
    TAG_BROKER,
    TAG_REQUEST,
    ErrorKind,
    InstanceInfo,
    InstanceRef,
    InstanceState,
    Offer,
    Provider,
    ProviderError,
    ProvisionRequest,
    derive_request_key,
    tags_tuple,
)
from providers.bootstrap import DEFAULT_AGENT_INSTALL, agent_boot_script

log = logging.getLogger(__name__)
# Sorts before every launch time EC2 reports (aware, UTC): an instance without one comes first.
_NEVER = datetime.min.replace(tzinfo=timezone.utc)

# Deep Learning Base AMI with NVIDIA driver, published by AWS through public SSM parameters.
DEFAULT_AMI_SSM_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"

_STATES = {
    "pending": InstanceState.PENDING,
    "running": InstanceState.RUNNING,
    "stopping": InstanceState.STOPPING,
    "stopped": InstanceState.STOPPED,
    "shutting-down": InstanceState.TERMINATING,
    "terminated": InstanceState.TERMINATED,
}
_ZONE_ID = re.compile(r"^[a-z]{2,5}\d+-(?:[a-z]+\d*-)?az\d+$")  # use1-az1, usw2-lax1-az1


def client_token(*, allocation_id: str, attempt: int, instance_type: str, zone: str) -> str:
    """The EC2 ClientToken (= the broker's request key) of one launch attempt: <= 64 ASCII
    characters, stable for the same allocation, attempt, type and zone. Store it first."""
    return derive_request_key(
        allocation_id=allocation_id, attempt=attempt, provider="aws", instance_type=instance_type, zone=zone
    )


def instance_info(region: str, instance: Mapping[str, Any]) -> InstanceInfo:
    tags = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}
    return InstanceInfo(
        ref=InstanceRef(
            provider="aws",
            region=region,
            zone=instance.get("Placement", {}).get("AvailabilityZone", ""),
            instance_id=instance["InstanceId"],
        ),
        state=_STATES.get(instance.get("State", {}).get("Name", ""), InstanceState.UNKNOWN),
        instance_type=instance.get("InstanceType", ""),
        spot=instance.get("InstanceLifecycle") == "spot",
        request_key=tags.get(TAG_REQUEST, ""),
        launched_at=instance.get("LaunchTime"),
        private_ip=instance.get("PrivateIpAddress", "") or "",
        public_ip=instance.get("PublicIpAddress", "") or "",
        tags=tags_tuple(tags),
        state_reason=instance.get("StateReason", {}).get("Code", "") or "",
    )


class AwsProvider(Provider):
    kind = "aws"

    def __init__(
        self,
        *,
        broker_id: str,
        regions: Sequence[str],
        offers: Sequence[Offer] | None = None,
        image_ids: Mapping[str, str] | None = None,
        subnet_ids: Mapping[str, str] | None = None,
        security_group_ids: Sequence[str] = (),
        iam_instance_profile: str = "",
        key_name: str = "",
        root_volume_gib: int = 200,
        agent_install_command: str = DEFAULT_AGENT_INSTALL,
        session: boto3.session.Session | None = None,
        endpoint_url: str | None = None,
        client_factory: Callable[[str], Any] | None = None,
    ) -> None:
        super().__init__(broker_id=broker_id)
        self.regions = list(regions)
        self._catalog_offers = offers
        self.image_ids = dict(image_ids or {})
        self.subnet_ids = dict(subnet_ids or {})  # zone name -> subnet id
        self.security_group_ids = list(security_group_ids)
        self.iam_instance_profile = iam_instance_profile
        self.key_name = key_name
        self.root_volume_gib = root_volume_gib
        self.agent_install_command = agent_install_command
        self._session = session
        self._client_factory = client_factory or (
            lambda region: make_ec2_client(region, session=session, endpoint_url=endpoint_url)
        )
        self._clients: dict[str, Any] = {}
        self._zone_names: dict[tuple[str, str], str] = {}
        self._root_devices: dict[tuple[str, str], str] = {}
        self._type_facts: dict[str, dict[str, dict[str, Any]]] = {}

    def __repr__(self) -> str:  # never show sessions/credentials
        return f"AwsProvider(broker_id={self.broker_id!r}, regions={self.regions!r})"

    # -- clients and lookups -------------------------------------------------------------
    def client(self, region: str) -> Any:
        if region not in self._clients:
            self._clients[region] = self._client_factory(region)
        return self._clients[region]

    def _call(self, region: str, method: str, **kwargs: Any) -> Any:
        try:
            return getattr(self.client(region), method)(**kwargs)
        except ClientError as exc:
            raise map_client_error(exc) from exc
        except BotoCoreError as exc:
            raise map_boto_error(exc) from exc

    def zone_name(self, region: str, zone: str) -> str:
        """Accept an AZ name (us-east-1a) or an AZ id (use1-az1, what the public catalog uses)."""
        if not zone or not _ZONE_ID.match(zone):
            return zone
        key = (region, zone)
        if key not in self._zone_names:
            zones = self._call(region, "describe_availability_zones", ZoneIds=[zone])["AvailabilityZones"]
            if not zones:
                raise ProviderError(ErrorKind.BAD_REQUEST, f"no zone {zone} in {region}", provider="aws",
                                    retry_elsewhere=True)
            self._zone_names[key] = zones[0]["ZoneName"]
        return self._zone_names[key]

    def _image_id(self, request: ProvisionRequest) -> str:
        if request.image:
            return request.image
        if request.region in self.image_ids:
            return self.image_ids[request.region]
        try:
            ssm = (self._session or boto3.session.Session()).client("ssm", region_name=request.region)
            image = ssm.get_parameter(Name=DEFAULT_AMI_SSM_PARAMETER)["Parameter"]["Value"]
        except (ClientError, BotoCoreError) as exc:
            raise ProviderError(ErrorKind.BAD_REQUEST, f"no AMI configured for {request.region} and the "
                                f"default could not be resolved ({type(exc).__name__})", provider="aws") from exc
        self.image_ids[request.region] = image
        return image

    def _root_device(self, region: str, image_id: str) -> str:
        key = (region, image_id)
        if key not in self._root_devices:
            images = self._call(region, "describe_images", ImageIds=[image_id])["Images"]
            if not images:
                raise ProviderError(ErrorKind.BAD_REQUEST, f"AMI {image_id} not found in {region}", provider="aws")
            self._root_devices[key] = images[0].get("RootDeviceName", "/dev/sda1")
        return self._root_devices[key]

    # -- the contract --------------------------------------------------------------------
    def list_offers(self) -> list[Offer]:
        """Catalog offers in our regions, with GPU facts (count, memory, vCPU, memory)
        corrected from `describe_instance_types` when the API answers."""
        if self._catalog_offers is None:
            from providers.catalog.loader import load_default_catalog

            self._catalog_offers = load_default_catalog().offers
        offers = [o for o in self._catalog_offers if o.provider == "aws" and o.region in self.regions]
        result: list[Offer] = []
        for region in self.regions:
            regional = [o for o in offers if o.region == region]
            try:
                facts = self.instance_type_facts(region, sorted({o.instance_type for o in regional}))
            except ProviderError as exc:
                log.warning("describe_instance_types failed in %s (%s); using catalog facts", region, exc.kind.value)  # pragma: no mutate
                facts = {}
            result += [self._with_facts(o, facts.get(o.instance_type)) for o in regional]
        return result

    def instance_type_facts(self, region: str, instance_types: Sequence[str]) -> dict[str, dict[str, Any]]:
        cache = self._type_facts.setdefault(region, {})
        missing = [t for t in instance_types if t not in cache]
        for start in range(0, len(missing), 100):
            paginator = self.client(region).get_paginator("describe_instance_types")
            try:
                for page in paginator.paginate(Filters=[{"Name": "instance-type", "Values": missing[start:start + 100]}]):
                    for item in page["InstanceTypes"]:
                        cache[item["InstanceType"]] = item
            except ClientError as exc:
                raise map_client_error(exc) from exc
            except BotoCoreError as exc:
                raise map_boto_error(exc) from exc
        return {t: cache[t] for t in instance_types if t in cache}

    @staticmethod
    def _with_facts(offer: Offer, facts: Mapping[str, Any] | None) -> Offer:
        if not facts or "GpuInfo" not in facts:
            return offer
        gpus = facts["GpuInfo"].get("Gpus", [])
        if not gpus:
            return offer
        return dataclasses.replace(
            offer,
            gpu_count=sum(int(g.get("Count", 0)) for g in gpus) or offer.gpu_count,
            gpu_memory_mib=int(gpus[0].get("MemoryInfo", {}).get("SizeInMiB", 0)) or offer.gpu_memory_mib,
            vcpus=float(facts.get("VCpuInfo", {}).get("DefaultVCpus", offer.vcpus)),
            memory_gib=round(facts.get("MemoryInfo", {}).get("SizeInMiB", offer.memory_gib * 1024) / 1024, 1),
        )

    def find_by_request_key(self, region: str, request_key: str) -> list[InstanceInfo]:
        filters = [
            {"Name": f"tag:{TAG_BROKER}", "Values": [self.broker_id]},
            {"Name": f"tag:{TAG_REQUEST}", "Values": [request_key]},
        ]
        return self._describe(region, Filters=filters)

    def _describe(self, region: str, **kwargs: Any) -> list[InstanceInfo]:
        infos: list[InstanceInfo] = []
        try:
            for page in self.client(region).get_paginator("describe_instances").paginate(**kwargs):
                for reservation in page["Reservations"]:
                    infos += [instance_info(region, i) for i in reservation["Instances"]]
        except ClientError as exc:
            raise map_client_error(exc) from exc
        except BotoCoreError as exc:
            raise map_boto_error(exc) from exc
        return infos

    def provision(self, request: ProvisionRequest) -> InstanceInfo:
        if request.region not in self.regions:
            raise ProviderError(ErrorKind.BAD_REQUEST, f"region {request.region} is not configured", provider="aws")
        if len(request.request_key) > 64 or not request.request_key.isascii() or not request.request_key:
            raise ProviderError(ErrorKind.BAD_REQUEST, "request_key must be 1-64 ASCII characters", provider="aws")
        existing = self.find_by_request_key(request.region, request.request_key)
        if existing:
            # Same key, same instance: whatever its state, as EC2 itself does for a ClientToken.
            existing.sort(key=lambda i: (i.state is not InstanceState.TERMINATED, i.launched_at or _NEVER))
            log.info("aws: request %s already launched as %s", request.request_key, existing[-1].ref.instance_id)  # pragma: no mutate
            return existing[-1]
        response = self._call(request.region, "run_instances", **self.run_instances_params(request))
        info = instance_info(request.region, response["Instances"][0])
        log.info("aws: launched %s (%s, %s) for request %s", info.ref.instance_id, request.instance_type,  # pragma: no mutate
                 info.ref.zone, request.request_key)  # pragma: no mutate
        return info

    def run_instances_params(self, request: ProvisionRequest) -> dict[str, Any]:
        """Exactly what `run_instances` receives; a pure function of the request and the
        provider config, so a retry sends the same parameters with the same ClientToken."""
        tags = self.broker_tags(request)
        tags.setdefault("Name", request.node_name or request.request_key)
        tag_list = [{"Key": k, "Value": v} for k, v in sorted(tags.items())]
        resource_types = ["instance", "volume", "network-interface"]
        if request.spot:
            resource_types.append("spot-instances-request")
        image_id = self._image_id(request)
        params: dict[str, Any] = {
            "ImageId": image_id,
            "InstanceType": request.instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": request.request_key,
            "TagSpecifications": [{"ResourceType": rt, "Tags": tag_list} for rt in resource_types],
            "UserData": agent_boot_script(
                server_url=request.agent_server_url,
                join_token=request.agent_join_token,
                node_name=request.node_name or request.request_key,
                install_command=self.agent_install_command,
            ),
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
            # A node that shuts itself down must not linger as a stopped, billed volume.
            "InstanceInitiatedShutdownBehavior": "terminate",
            "BlockDeviceMappings": [
                {
                    "DeviceName": self._root_device(request.region, image_id),
                    "Ebs": {"VolumeSize": self.root_volume_gib, "VolumeType": "gp3", "DeleteOnTermination": True},
                }
            ],
        }
        zone = self.zone_name(request.region, request.zone)
        if zone:
            params["Placement"] = {"AvailabilityZone": zone}
        if zone in self.subnet_ids:
            params["SubnetId"] = self.subnet_ids[zone]
        if self.security_group_ids:
            params["SecurityGroupIds"] = self.security_group_ids
        if self.iam_instance_profile:
            params["IamInstanceProfile"] = {"Name": self.iam_instance_profile}
        if self.key_name:
            params["KeyName"] = self.key_name
        if request.spot:
            spot_options: dict[str, Any] = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
            if request.max_spot_price is not None:
                spot_options["MaxPrice"] = f"{request.max_spot_price:.5f}"
            params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot_options}
        return params

    def describe(self, ref: InstanceRef) -> InstanceInfo:
        try:
            found = self._describe(ref.region, InstanceIds=[ref.instance_id])
        except ProviderError as exc:
            if exc.kind is ErrorKind.NOT_FOUND:  # EC2 no longer knows it: confirmed gone
                return InstanceInfo(ref=ref, state=InstanceState.TERMINATED, state_reason="not-found")
            raise
        if not found:
            return InstanceInfo(ref=ref, state=InstanceState.TERMINATED, state_reason="not-found")
        return found[0]

    def terminate(self, ref: InstanceRef) -> InstanceInfo:
        """Ask EC2 to terminate; returns the state EC2 reports (usually TERMINATING). The
        caller keeps the record until `describe` says TERMINATED."""
        try:
            response = self._call(ref.region, "terminate_instances", InstanceIds=[ref.instance_id])
        except ProviderError as exc:
            if exc.kind is ErrorKind.NOT_FOUND:
                return InstanceInfo(ref=ref, state=InstanceState.TERMINATED, state_reason="not-found")
            raise
        change = response["TerminatingInstances"][0]
        state = _STATES.get(change["CurrentState"]["Name"], InstanceState.UNKNOWN)
        log.info("aws: terminate %s -> %s", ref.instance_id, state.value)  # pragma: no mutate
        return InstanceInfo(ref=ref, state=state)

    def list_owned(self) -> list[InstanceInfo]:
        owned: list[InstanceInfo] = []
        for region in self.regions:
            owned += self._describe(region, Filters=[{"Name": f"tag:{TAG_BROKER}", "Values": [self.broker_id]}])
        return owned
