"""GCP Compute Engine provider (google-cloud-compute, REST transport).

Idempotency: the instance name is derived from the broker's request key (a UUID5 of it), and
the same UUID is the insert's `requestId`. A retry within GCE's request window gets the same
operation back; a later one meets `409 alreadyExists` and we adopt the instance if it carries
our labels. Operations are waited on through our own ZoneOperationsClient, because
`ExtendedOperation.result()` would call the real Google endpoint whatever we configured.
"""
from __future__ import annotations

import logging
import re
import time
import uuid
from datetime import datetime
from typing import Any, Callable, Sequence

from google.api_core import exceptions as gexc
from google.cloud import compute_v1

from providers.base import (
    TAG_ALLOCATION,
    TAG_ATTEMPT,
    TAG_BROKER,
    TAG_NODE_NAME,
    TAG_REQUEST,
    ErrorKind,
    InstanceInfo,
    InstanceRef,
    InstanceState,
    Offer,
    Provider,
    ProviderError,
    ProvisionRequest,
    tags_tuple,
)
from providers.bootstrap import DEFAULT_AGENT_INSTALL, agent_boot_script
from providers.catalog.families import GCP_ACCELERATOR_TYPES, gcp_bundled_gpus
from providers.gcp.errors import ALREADY_EXISTS_CODES, map_api_error, map_operation_error

log = logging.getLogger(__name__)

# GCP label keys allow [a-z0-9_-] only: our AWS tag names with ':' -> '-'.
LABEL_BROKER = TAG_BROKER.replace(":", "-")
LABEL_REQUEST = TAG_REQUEST.replace(":", "-")
_LABEL_KEYS = {TAG_BROKER: LABEL_BROKER, TAG_REQUEST: LABEL_REQUEST, TAG_ALLOCATION: TAG_ALLOCATION.replace(":", "-"),
               TAG_ATTEMPT: TAG_ATTEMPT.replace(":", "-"), TAG_NODE_NAME: TAG_NODE_NAME.replace(":", "-")}
_NAME_NAMESPACE = uuid.UUID("5b0c5f4e-8d7e-4a51-9c55-57a1e2a10b0d")  # fixed: names must be stable across runs
_LABEL_UNSAFE = re.compile(r"[^a-z0-9_-]+")

# GCE "TERMINATED" means stopped (disks still billed), not deleted: deleted is a 404.
_STATES = {
    "PROVISIONING": InstanceState.PENDING, "STAGING": InstanceState.PENDING, "RUNNING": InstanceState.RUNNING,
    "STOPPING": InstanceState.STOPPING, "SUSPENDING": InstanceState.STOPPING, "SUSPENDED": InstanceState.STOPPED,
    "TERMINATED": InstanceState.STOPPED, "REPAIRING": InstanceState.UNKNOWN,
}
DEFAULT_IMAGE = "projects/debian-cloud/global/images/family/debian-12"


def label_value(value: str) -> str:
    """GCP label values: <= 63 chars of lowercase letters, digits, '_' and '-'."""
    return _LABEL_UNSAFE.sub("-", value.lower())[:63]


def instance_name(request_key: str) -> str:
    """The instance name of a request: UUID-based, fresh for every new request key, stable
    for retries of the same key. It is also the insert's requestId (see request_uuid)."""
    return f"wz-{request_uuid(request_key)}"


def request_uuid(request_key: str) -> str:
    return str(uuid.uuid5(_NAME_NAMESPACE, request_key))


def _last(url: str) -> str:
    return url.rsplit("/", 1)[-1] if url else ""


def instance_info(project_zone_region: str, instance: compute_v1.Instance) -> InstanceInfo:
    zone = _last(instance.zone)
    labels = dict(instance.labels)
    created = None
    if instance.creation_timestamp:
        created = datetime.fromisoformat(instance.creation_timestamp.replace("Z", "+00:00"))
    nic = instance.network_interfaces[0] if instance.network_interfaces else None
    return InstanceInfo(
        ref=InstanceRef(provider="gcp", region=zone.rsplit("-", 1)[0] or project_zone_region, zone=zone,
                        instance_id=instance.name),
        state=_STATES.get(instance.status, InstanceState.UNKNOWN),
        instance_type=_last(instance.machine_type),
        spot=instance.scheduling.provisioning_model == "SPOT",
        request_key=labels.get(LABEL_REQUEST, ""),
        launched_at=created,
        private_ip=nic.network_i_p if nic else "",
        public_ip=nic.access_configs[0].nat_i_p if nic and nic.access_configs else "",
        tags=tags_tuple(labels),
    )


class GcpProvider(Provider):
    kind = "gcp"

    def __init__(
        self,
        *,
        broker_id: str,
        project: str,
        regions: Sequence[str] = (),
        zones: Sequence[str] = (),
        offers: Sequence[Offer] | None = None,
        image: str = DEFAULT_IMAGE,
        network: str = "global/networks/default",
        subnetwork: str = "",
        external_ip: bool = True,
        service_account_email: str = "",
        boot_disk_gb: int = 200,
        agent_install_command: str = DEFAULT_AGENT_INSTALL,
        credentials: Any = None,
        api_endpoint: str | None = None,
        operation_timeout_s: float = 600.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(broker_id=broker_id)
        self.project = project
        self.regions = list(regions)  # offers are limited to these regions/zones when given
        self.zones = list(zones)
        self._catalog_offers = offers
        self.image = image
        self.network = network
        self.subnetwork = subnetwork
        self.external_ip = external_ip
        self.service_account_email = service_account_email
        self.boot_disk_gb = boot_disk_gb
        self.agent_install_command = agent_install_command
        self.operation_timeout_s = operation_timeout_s
        self._sleep = sleep
        client_options = {"api_endpoint": api_endpoint} if api_endpoint else None
        # REST, not gRPC: it works against a local endpoint and needs no extra dependencies.
        self._client_kwargs: dict[str, Any] = {"transport": "rest", "credentials": credentials,
                                               "client_options": client_options}
        self._instances: compute_v1.InstancesClient | None = None
        self._operations: compute_v1.ZoneOperationsClient | None = None

    def __repr__(self) -> str:  # never show credentials
        return f"GcpProvider(broker_id={self.broker_id!r}, project={self.project!r})"

    @property
    def instances_client(self) -> compute_v1.InstancesClient:
        if self._instances is None:
            self._instances = compute_v1.InstancesClient(**self._client_kwargs)
        return self._instances

    @property
    def operations_client(self) -> compute_v1.ZoneOperationsClient:
        if self._operations is None:
            self._operations = compute_v1.ZoneOperationsClient(**self._client_kwargs)
        return self._operations

    def accelerator_types_client(self) -> compute_v1.AcceleratorTypesClient:
        """For providers.catalog.GcpAvailability."""
        return compute_v1.AcceleratorTypesClient(**self._client_kwargs)

    def _call(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except Exception as exc:  # every API/transport failure becomes a ProviderError
            raise map_api_error(exc) from exc

    # -- the contract --------------------------------------------------------------------
    def list_offers(self) -> list[Offer]:
        if self._catalog_offers is None:
            from providers.catalog.loader import load_default_catalog

            self._catalog_offers = load_default_catalog().offers
        return [o for o in self._catalog_offers
                if o.provider == "gcp" and (not self.regions or o.region in self.regions)
                and (not self.zones or o.zone in self.zones)]

    def labels_for(self, request: ProvisionRequest) -> dict[str, str]:
        tags = self.broker_tags(request)
        return {_LABEL_KEYS.get(k, label_value(k.replace(":", "-"))): label_value(v) for k, v in tags.items()}

    def _owns(self, instance: compute_v1.Instance, request: ProvisionRequest) -> bool:
        labels = dict(instance.labels)
        return (labels.get(LABEL_BROKER) == label_value(self.broker_id)
                and labels.get(LABEL_REQUEST) == label_value(request.request_key))

    def provision(self, request: ProvisionRequest) -> InstanceInfo:
        if not request.zone:
            raise ProviderError(ErrorKind.BAD_REQUEST, "GCP needs a zone", provider="gcp")
        name = instance_name(request.request_key)
        resource = self.instance_resource(request, name)
        insert = compute_v1.InsertInstanceRequest(
            project=self.project, zone=request.zone, instance_resource=resource, request_id=request_uuid(request.request_key)
        )
        try:
            operation = self.instances_client.insert(request=insert)
        except gexc.Conflict:
            return self._adopt(request, name)
        except Exception as exc:
            raise map_api_error(exc) from exc
        done = self.wait_for_operation(request.zone, operation.name)
        if done.error and done.error.errors:
            if done.error.errors[0].code in ALREADY_EXISTS_CODES:
                return self._adopt(request, name)
            raise map_operation_error(list(done.error.errors))
        log.info("gcp: created %s (%s, %s) for request %s", name, request.instance_type, request.zone,  # pragma: no mutate
                 request.request_key)  # pragma: no mutate
        return self.describe(InstanceRef(provider="gcp", region=request.region, zone=request.zone, instance_id=name))

    def _adopt(self, request: ProvisionRequest, name: str) -> InstanceInfo:
        instance = self._call(self.instances_client.get, project=self.project, zone=request.zone, instance=name)
        if not self._owns(instance, request):
            raise ProviderError(ErrorKind.BAD_REQUEST, f"instance {name} exists but does not carry this "
                                "request's labels; not adopting it", provider="gcp", code="alreadyExists")
        log.info("gcp: request %s already created %s; adopting it", request.request_key, name)  # pragma: no mutate
        return instance_info(request.region, instance)

    def instance_resource(self, request: ProvisionRequest, name: str) -> compute_v1.Instance:
        zone = request.zone
        labels = self.labels_for(request)
        script = agent_boot_script(
            server_url=request.agent_server_url,
            join_token=request.agent_join_token,
            node_name=request.node_name or name,
            install_command=self.agent_install_command,
        )
        nic = compute_v1.NetworkInterface(network=self.network)
        if self.subnetwork:
            nic.subnetwork = self.subnetwork
        if self.external_ip:
            nic.access_configs = [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
        instance = compute_v1.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{request.instance_type}",
            labels=labels,
            disks=[compute_v1.AttachedDisk(
                boot=True,
                auto_delete=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image=request.image or self.image, disk_size_gb=self.boot_disk_gb,
                    disk_type=f"zones/{zone}/diskTypes/pd-balanced", labels=labels,
                ),
            )],
            network_interfaces=[nic],
            metadata=compute_v1.Metadata(items=[
                compute_v1.Items(key="startup-script", value=script),
                compute_v1.Items(key="install-nvidia-driver", value="True"),  # honoured by Deep Learning VM images
            ]),
            # GPU instances cannot live-migrate: host maintenance must stop them.
            scheduling=compute_v1.Scheduling(
                on_host_maintenance="TERMINATE",
                automatic_restart=not request.spot,
                provisioning_model="SPOT" if request.spot else "STANDARD",
            ),
        )
        if request.spot:
            # Deleted, not stopped, on preemption: a stopped spot VM still bills its disk and
            # would look alive to the reconciler.
            instance.scheduling.instance_termination_action = "DELETE"
        if gcp_bundled_gpus(request.instance_type) is None and request.gpu_model and request.gpu_count:
            # N1 takes attached GPUs; A2/A3/G2 come with theirs and must not list them again.
            if request.gpu_model not in GCP_ACCELERATOR_TYPES:
                raise ProviderError(ErrorKind.BAD_REQUEST, f"unknown GPU model {request.gpu_model}", provider="gcp")
            instance.guest_accelerators = [compute_v1.AcceleratorConfig(
                accelerator_type=f"zones/{zone}/acceleratorTypes/{GCP_ACCELERATOR_TYPES[request.gpu_model]}",
                accelerator_count=request.gpu_count,
            )]
        if self.service_account_email:
            instance.service_accounts = [compute_v1.ServiceAccount(
                email=self.service_account_email, scopes=["https://www.googleapis.com/auth/cloud-platform"])]
        return instance

    def wait_for_operation(self, zone: str, operation_name: str) -> compute_v1.Operation:
        """Wait through ZoneOperations.wait (returns when done or after ~2 min server-side),
        until DONE or our own deadline; a deadline is transient: retrying the same request
        key meets the same requestId or 409 and adopts."""
        deadline = time.monotonic() + self.operation_timeout_s
        while True:
            operation = self._call(self.operations_client.wait, project=self.project, zone=zone,
                                   operation=operation_name)
            if operation.status == compute_v1.Operation.Status.DONE:
                return operation
            if time.monotonic() >= deadline:
                raise ProviderError(ErrorKind.TRANSIENT, f"operation {operation_name} still running after "
                                    f"{self.operation_timeout_s:.0f}s", provider="gcp", code="OperationTimeout")
            self._sleep(1.0)

    def describe(self, ref: InstanceRef) -> InstanceInfo:
        try:
            instance = self.instances_client.get(project=self.project, zone=ref.zone, instance=ref.instance_id)
        except gexc.NotFound:  # deleted: GCE confirms it no longer exists
            return InstanceInfo(ref=ref, state=InstanceState.TERMINATED, state_reason="not-found")
        except Exception as exc:
            raise map_api_error(exc) from exc
        return instance_info(ref.region, instance)

    def terminate(self, ref: InstanceRef) -> InstanceInfo:
        """Request deletion; returns TERMINATING (or TERMINATED if already gone). The caller
        keeps its record until `describe` says TERMINATED (a 404)."""
        try:
            self.instances_client.delete(
                request=compute_v1.DeleteInstanceRequest(
                    project=self.project, zone=ref.zone, instance=ref.instance_id,
                    request_id=str(uuid.uuid5(_NAME_NAMESPACE, "delete:" + ref.instance_id)),
                )
            )
        except gexc.NotFound:
            return InstanceInfo(ref=ref, state=InstanceState.TERMINATED, state_reason="not-found")
        except Exception as exc:
            raise map_api_error(exc) from exc
        log.info("gcp: delete requested for %s", ref.instance_id)  # pragma: no mutate
        return InstanceInfo(ref=ref, state=InstanceState.TERMINATING)

    def list_owned(self) -> list[InstanceInfo]:
        """Every instance labelled with our broker id, in every zone of the project (a leak in a
        zone we no longer use still costs money)."""
        request = compute_v1.AggregatedListInstancesRequest(
            project=self.project, filter=f'labels.{LABEL_BROKER} = "{label_value(self.broker_id)}"',
        )
        pager = self._call(self.instances_client.aggregated_list, request=request)
        owned: list[InstanceInfo] = []
        try:
            for _scope, scoped in pager:
                owned += [instance_info("", i) for i in scoped.instances]
        except Exception as exc:  # later pages are fetched lazily
            raise map_api_error(exc) from exc
        return owned
