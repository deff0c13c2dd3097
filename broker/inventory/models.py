"""What there is to run on: GPU models, pools of nodes, nodes, their GPUs, cloud instances."""
from __future__ import annotations

from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models

from broker.tenancy.models import Tenant


class GpuModel(models.Model):
    """A GPU product. Global (not per tenant): the broker's catalogue of what it can schedule."""

    name = models.CharField(max_length=64, unique=True, help_text="Canonical name, e.g. A100-80GB")
    vendor = models.CharField(max_length=32, default="NVIDIA")
    aliases = models.JSONField(default=list, blank=True, help_text="Other spellings users may write")
    memory_gb = models.PositiveIntegerField()
    compute_units = models.DecimalField(
        max_digits=8, decimal_places=3, validators=[MinValueValidator(0)],
        help_text="Dense BF16/FP16 tensor throughput relative to an A100 (A100 = 1.0)",
    )
    peak_dense_tflops = models.DecimalField(max_digits=8, decimal_places=1, default=Decimal("0"))
    nvlink = models.BooleanField(default=False)
    mig_profiles = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class PoolKind(models.TextChoices):
    ONPREM = "onprem", "On-prem"
    AWS = "aws", "AWS"
    GCP = "gcp", "GCP"
    LOCAL = "local", "Local simulator"
    KUBERNETES = "kubernetes", "Kubernetes cluster"


# Capacity the platform owns (billed at internal rates, counted against owned-GPU quotas); the other kinds
# are rented by the hour. A Kubernetes pool is an existing cluster of the platform's (agent/kube/).
OWNED_POOL_KINDS = (PoolKind.ONPREM, PoolKind.KUBERNETES)


class Pool(models.Model):
    """A set of nodes owned by one tenant: an on-prem cluster, a cloud account+region, the simulator."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="pools")
    name = models.CharField(max_length=100)
    kind = models.CharField(max_length=16, choices=PoolKind.choices)
    region = models.CharField(max_length=64, blank=True)
    credentials_ref = models.CharField(
        max_length=200, blank=True, help_text="Name of a secret holding cloud credentials; never the secret"
    )
    gpu_hour_rate_usd = models.DecimalField(
        max_digits=10, decimal_places=4, default=Decimal("0"), validators=[MinValueValidator(0)],
        help_text="Internal $/GPU-hour charged for on-prem capacity (the chargeback price teams are billed)",
    )
    # What the scheduler prices owned capacity at: one more GPU-hour on GPUs the platform already owns
    # costs it only this (power, wear), not the chargeback rate, so idle owned GPUs are used before
    # anything is rented. Rented capacity is priced at what the cloud charges.
    marginal_cost_usd_per_gpu_hour = models.DecimalField(
        max_digits=10, decimal_places=4, default=Decimal("0"), validators=[MinValueValidator(0)],
        help_text="On-prem: what one more GPU-hour costs the platform (power); the scheduler prices owned "
                  "GPUs at this, not at the chargeback rate",
    )
    # CPU and memory chargeback (owned pools only: a rented instance's price already covers its CPU and
    # memory). Null = not charged, the default. Fixed per allocation when its price is (AllocationMeter).
    cpu_rate_usd_per_core_hour = models.DecimalField(
        max_digits=12, decimal_places=6, null=True, blank=True, validators=[MinValueValidator(0)],
        help_text="Owned pools: $ per vCPU-hour a job requests (blank: CPU is not charged)",
    )
    memory_rate_usd_per_gib_hour = models.DecimalField(
        max_digits=12, decimal_places=6, null=True, blank=True, validators=[MinValueValidator(0)],
        help_text="Owned pools: $ per GiB-hour of memory a job requests (blank: memory is not charged)",
    )
    join_token_prefix = models.CharField(max_length=16, blank=True)
    join_token_hash = models.CharField(max_length=64, blank=True)
    provider_config = models.JSONField(
        default=dict, blank=True,
        help_text="Provider settings (regions, image ids, endpoint...); never credentials",
    )
    max_instances = models.PositiveIntegerField(
        default=0, help_text="Cloud pools: how many instances the broker may run at once (account quota)"
    )
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="uniq_pool_name")]
        ordering = ["tenant_id", "name"]

    def __str__(self) -> str:
        return f"{self.tenant}/{self.name}"

    def clean(self) -> None:
        """CPU and memory rates only on owned pools: on a cloud pool the instance price covers them."""
        super().clean()
        if self.kind in (PoolKind.AWS, PoolKind.GCP):
            errors = {name: f"On a cloud pool ({self.get_kind_display()}) the instance price already covers CPU "
                            "and memory: CPU and memory rates apply to owned pools only."
                      for name in RESOURCE_RATE_FIELDS if getattr(self, name) is not None}
            if errors:
                raise ValidationError(errors)


RESOURCE_RATE_FIELDS = ("cpu_rate_usd_per_core_hour", "memory_rate_usd_per_gib_hour")


class PoolGrant(models.Model):
    """A team other than the pool's owner may use the pool: place jobs on its nodes and, for a cloud
    pool, rent instances through it (the instances stay the owner's; the team's job holds their GPUs).

    The owner (for a shared cluster the platform's own tenant) always may; a pool without grants is
    its owner's alone, as every pool was before pools were shared. Grants also tie teams into one
    scheduling component: one cycle decides for every team that can reach the same capacity."""

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="grants")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="pool_grants")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["pool", "tenant"], name="uniq_pool_grant")]
        ordering = ["pool_id", "tenant_id"]

    def __str__(self) -> str:
        return f"{self.pool} -> {self.tenant}"


class NodeState(models.TextChoices):
    ONLINE = "ONLINE", "Online"
    DRAINING = "DRAINING", "Draining"
    LOST = "LOST", "Lost"
    OFFLINE = "OFFLINE", "Offline"


class Node(models.Model):
    """A machine with GPUs. The tenant is copied from the pool so every query can filter on it."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="nodes")
    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="nodes")
    name = models.CharField(max_length=200)
    hostname = models.CharField(max_length=255, blank=True)
    # Where the node's peers reach it (a multi-node gang's WHALEZEN_NODE_IPS / MASTER_ADDR): the
    # agent's --advertise-address, else the address its registration came from.
    address = models.CharField(max_length=255, blank=True)
    # Container runtimes the agent found (podman, docker, apptainer): image jobs go only where one is.
    container_runtimes = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.ONLINE)
    cpu_milli = models.PositiveIntegerField(default=0)
    memory_mb = models.PositiveIntegerField(default=0)
    labels = models.JSONField(default=dict, blank=True)
    token_prefix = models.CharField(max_length=16, blank=True)
    token_hash = models.CharField(max_length=64, blank=True)
    epoch = models.PositiveIntegerField(default=0, help_text="Bumped on every assignment change")
    agent_version = models.CharField(max_length=32, blank=True)
    topology = models.JSONField(default=dict, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # The cloud's notice that it takes this instance back (spot): kind, action, deadline, source,
    # received_at. Set once by the first heartbeat that carries it; the node is DRAINING from then.
    interruption = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["pool", "name"], name="uniq_node_name_in_pool")]
        ordering = ["pool_id", "name"]

    def __str__(self) -> str:
        return self.name


class GpuHealth(models.TextChoices):
    HEALTHY = "HEALTHY", "Healthy"
    DEGRADED = "DEGRADED", "Degraded"
    FAILED = "FAILED", "Failed"


class Gpu(models.Model):
    """One GPU of a node, with its place in the topology and its latest telemetry."""

    # Number of allocation slots a GPU is cut into: a whole-GPU job holds all of them,
    # a `gpu_fraction` job holds ceil(fraction * SLOTS). The database refuses a slot held twice.
    SLOTS = 10

    @classmethod
    def slots_for(cls, milli: int) -> int:
        """Slots a share of `milli` thousandths of a GPU holds: rounded up, at least one, at most all."""
        return min(cls.SLOTS, max(1, -(-milli * cls.SLOTS // 1000)))

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=64, blank=True)
    model = models.ForeignKey(GpuModel, on_delete=models.PROTECT, null=True, blank=True, related_name="gpus")
    model_name = models.CharField(max_length=64, help_text="Name as reported by the driver")
    memory_mb = models.PositiveIntegerField()
    nvlink_island = models.SmallIntegerField(null=True, blank=True)
    numa_node = models.SmallIntegerField(null=True, blank=True)
    pci_bus_id = models.CharField(max_length=32, blank=True)
    mig_mode = models.BooleanField(default=False)
    health = models.CharField(max_length=16, choices=GpuHealth.choices, default=GpuHealth.HEALTHY)
    utilization_pct = models.PositiveSmallIntegerField(null=True, blank=True)
    memory_used_mb = models.PositiveIntegerField(null=True, blank=True)
    temperature_c = models.SmallIntegerField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)
    ecc_errors = models.PositiveIntegerField(default=0)
    # Taken by work the broker did not place: on a Kubernetes node, the GPU requests of pods that are not
    # WhaleZen's (its bridge reports how many). The scheduler counts such a GPU as fully used.
    held_outside = models.BooleanField(default=False)
    last_seen_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="uniq_gpu_index"),
            # A UUID names one physical GPU: on two nodes it was copied (a leaked join token) or the
            # GPU moved without its old node being cleaned up. Empty means "not known".
            models.UniqueConstraint(fields=["uuid"], condition=~models.Q(uuid=""), name="uniq_gpu_uuid"),
        ]
        ordering = ["node_id", "index"]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.index}"


class InstanceState(models.TextChoices):
    REQUESTED = "REQUESTED", "Requested"
    PENDING = "PENDING", "Pending"
    RUNNING = "RUNNING", "Running"
    TERMINATING = "TERMINATING", "Terminating"
    TERMINATED = "TERMINATED", "Terminated"
    FAILED = "FAILED", "Failed"


class CloudInstance(models.Model):
    """A cloud VM we asked for. Recorded before the cloud call, so a crash cannot leak it."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="cloud_instances")
    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="cloud_instances")
    node = models.OneToOneField(Node, on_delete=models.SET_NULL, null=True, blank=True, related_name="instance")
    request_key = models.CharField(max_length=64, unique=True, help_text="Idempotency key sent to the cloud")
    provider_id = models.CharField(max_length=128, blank=True)
    offer = models.JSONField(default=dict, help_text="The catalog offer it was launched from")
    instance_type = models.CharField(max_length=64)
    zone = models.CharField(max_length=64, blank=True)
    spot = models.BooleanField(default=False)
    state = models.CharField(max_length=16, choices=InstanceState.choices, default=InstanceState.REQUESTED)
    attempt = models.PositiveIntegerField(default=1)
    node_name = models.CharField(max_length=200, blank=True, help_text="The name its agent registers under")
    placements = models.JSONField(default=list, blank=True,
                                  help_text="Jobs waiting for this instance: [{job_id, gpu_indices, milli}]")
    join_token_hash = models.CharField(max_length=64, blank=True, help_text="One-time agent join token")
    last_error = models.TextField(blank=True)
    tags = models.JSONField(default=dict, blank=True)
    hourly_price_usd = models.DecimalField(max_digits=10, decimal_places=4, default=Decimal("0"))
    created_at = models.DateTimeField(auto_now_add=True)
    terminated_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.instance_type} {self.provider_id or self.request_key}"


class OfferBlock(models.Model):
    """A place (provider, region, zone, instance type) that just failed with a capacity or quota error.

    The scheduler leaves it out of the offers until `until`, so the next cycle fails over elsewhere.
    """

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="offer_blocks")
    region = models.CharField(max_length=64)
    zone = models.CharField(max_length=64, blank=True)
    instance_type = models.CharField(max_length=64)
    until = models.DateTimeField()
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["pool", "until"])]
