"""/api/v1/gpu-models/, /pools/, /nodes/, /quota/: what a tenant can run on, and its limits.

Pools and nodes are those the team may use (broker.inventory.selectors): its own and those shared with
it (`shared`, `owned`). A shared node's GPUs say what holds them: one of the team's own jobs by id, or
"in use by another team" with nothing more (no id, name, user or spec; hostile tenancy, DESIGN.md).
"""
from __future__ import annotations

from collections import defaultdict

import django_filters
from django.db.models import Exists, OuterRef, Prefetch, QuerySet
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from broker.api.base import TenantReadOnlyViewSet
from broker.api.schema import WhaleZenAutoSchema
from broker.inventory.labels import POD_VISIBILITY_LABEL, valid_labels
from broker.inventory.models import Gpu, GpuModel, Node, NodeState, Pool, PoolGrant
from broker.inventory.selectors import nodes_usable_by, pools_usable_by
from broker.jobs.models import AllocationSlice
from broker.jobs.selectors import tenant_gpu_usage
from broker.tenancy.selectors import team_quota_usage
from broker.tenancy.models import Quota
from broker.tenancy.permissions import tenant_context

OTHER_TEAM = "in use by another team"


class GpuModelSerializer(serializers.ModelSerializer):
    class Meta:
        model = GpuModel
        fields = ["id", "name", "vendor", "aliases", "memory_gb", "compute_units", "peak_dense_tflops",
                  "nvlink", "mig_profiles"]


class GpuModelViewSet(viewsets.ReadOnlyModelViewSet):
    """The GPU catalogue is shared by all tenants (it holds no tenant data)."""

    queryset = GpuModel.objects.all()
    serializer_class = GpuModelSerializer
    lookup_value_regex = "[0-9]+"  # ASCII digits only: `\d` and int() also take "²" or "٣"
    schema = WhaleZenAutoSchema()


def _caller_tenant_id(context: dict) -> int | None:
    request = context.get("request")
    ctx = tenant_context(request) if request is not None else None
    return ctx.tenant.pk if ctx is not None else None


class PoolSerializer(serializers.ModelSerializer):
    node_count = serializers.IntegerField(source="nodes.count", read_only=True)
    owned = serializers.SerializerMethodField(help_text="Whether the caller's team owns the pool.")
    shared = serializers.SerializerMethodField(
        help_text="Whether more than one team may use the pool: a pool shared with the caller, or one the "
                  "caller's team owns and shares. Which other teams it is shared with is not shown.")
    owner = serializers.SerializerMethodField(help_text="The slug of the team that owns the pool.")
    status = serializers.SerializerMethodField(
        help_text="What limits how the pool is seen, one sentence each (empty when nothing does): e.g. a "
                  "Kubernetes cluster that forbids listing pods in all namespaces.")

    class Meta:
        model = Pool
        fields = ["id", "name", "kind", "region", "gpu_hour_rate_usd", "cpu_rate_usd_per_core_hour",
                  "memory_rate_usd_per_gib_hour", "marginal_cost_usd_per_gpu_hour", "enabled",
                  "node_count", "owned", "shared", "owner", "status", "created_at"]

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_status(self, pool: Pool) -> list[str]:
        if not getattr(pool, "namespace_only", False):
            return []
        namespace = (pool.provider_config or {}).get("namespace")
        counted = f"namespace {namespace}" if namespace else "the bridge's own namespace"
        return [f"The cluster forbids listing pods in all namespaces (403): free GPUs count only the pods of "
                f"{counted}; GPUs that other namespaces' pods hold look free until kube-scheduler refuses a Pod."]

    def get_owned(self, pool: Pool) -> bool:
        return pool.tenant_id == _caller_tenant_id(self.context)

    def get_shared(self, pool: Pool) -> bool:
        if pool.tenant_id != _caller_tenant_id(self.context):
            return True  # it is listed only because it is shared with the caller
        return bool(getattr(pool, "has_grants", False))

    def get_owner(self, pool: Pool) -> str:
        # The owner shared the pool with the caller's team: who provides the capacity is no secret (for a
        # shared cluster it is the platform's own tenant); the other grantees are never listed.
        return pool.tenant.slug


class PoolViewSet(TenantReadOnlyViewSet):
    """Pools the team may use: its own and those shared with it (another team's pool is 404)."""

    queryset = Pool.objects.select_related("tenant").annotate(
        has_grants=Exists(PoolGrant.objects.filter(pool=OuterRef("pk"))),
        # The Kubernetes bridge labels each node with what it could count (agent/kube/bridge.py).
        namespace_only=Exists(Node.objects.filter(pool=OuterRef("pk"), **{
            f"labels__{POD_VISIBILITY_LABEL}": "namespace-only"})))
    serializer_class = PoolSerializer
    lookup_value_regex = "[0-9]+"  # ASCII digits only: `\d` and int() also take "²" or "٣"
    schema = WhaleZenAutoSchema()

    def scope(self, queryset: QuerySet) -> QuerySet:
        return queryset.filter(pk__in=pools_usable_by(self.ctx.tenant).values("pk"))


class GpuHolderSerializer(serializers.Serializer):
    job = serializers.IntegerField(allow_null=True, help_text="The caller's job holding the share; null for "
                                                              "another team's")
    share = serializers.FloatField(help_text="Share of the GPU held, 0..1")
    holder = serializers.CharField(help_text='"your team" or "in use by another team"')


class GpuSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model_name")
    in_use = serializers.SerializerMethodField()
    held_by = serializers.SerializerMethodField(
        help_text="What holds the GPU: the caller's jobs by id, and one entry for all other teams' jobs "
                  "together (\"in use by another team\", no id).")

    # Telemetry that follows what a job does (its load, memory, power): hidden while another team's job
    # holds part of the GPU, so a team cannot watch another team's work through a shared node.
    JOB_TELEMETRY = ("utilization_pct", "memory_used_mb", "power_w")

    class Meta:
        model = Gpu
        fields = ["index", "uuid", "model", "memory_mb", "nvlink_island", "numa_node", "pci_bus_id", "mig_mode",
                  "health", "utilization_pct", "memory_used_mb", "temperature_c", "power_w", "ecc_errors",
                  "last_seen_at", "in_use", "held_by", "held_outside"]
        extra_kwargs = {"held_outside": {"help_text": "Taken by work WhaleZen did not place (on a Kubernetes node: "
                                                      "another pod's GPU request); not free"}}

    def _active(self, gpu: Gpu) -> list[AllocationSlice]:
        return [s for s in gpu.slices.all() if s.active]

    def get_in_use(self, gpu: Gpu) -> float:
        """Share of the GPU held by allocations, 0..1."""
        return round(sum(piece.slots for piece in self._active(gpu)) / Gpu.SLOTS, 3)

    @extend_schema_field(GpuHolderSerializer(many=True))
    def get_held_by(self, gpu: Gpu) -> list[dict]:
        caller = _caller_tenant_id(self.context)
        own: dict[int, int] = defaultdict(int)
        others = 0
        for piece in self._active(gpu):
            job = piece.allocation.job
            if job.tenant_id == caller:
                own[job.pk] += piece.slots
            else:
                others += piece.slots
        held = [{"job": job_id, "share": round(slots / Gpu.SLOTS, 3), "holder": "your team"}
                for job_id, slots in sorted(own.items())]
        if others:
            held.append({"job": None, "share": round(others / Gpu.SLOTS, 3), "holder": OTHER_TEAM})
        return held

    def to_representation(self, gpu: Gpu) -> dict:
        data = super().to_representation(gpu)
        caller = _caller_tenant_id(self.context)
        if any(piece.allocation.job.tenant_id != caller for piece in self._active(gpu)):
            for name in self.JOB_TELEMETRY:
                data[name] = None
        return data


class NodeSerializer(serializers.ModelSerializer):
    pool = serializers.CharField(source="pool.name")
    pool_id = serializers.IntegerField(read_only=True)
    shared = serializers.SerializerMethodField(help_text="Whether the node's pool is used by more than one team.")
    owned = serializers.SerializerMethodField(help_text="Whether the caller's team owns the node's pool.")
    gpus = GpuSerializer(many=True, read_only=True)
    labels = serializers.SerializerMethodField()
    job_isolation = serializers.SerializerMethodField(
        help_text='How its agent runs jobs: "separate-user", or "shared-user" (jobs could read the agent\'s '
                  'secrets); null when the agent did not say.')

    class Meta:
        model = Node
        fields = ["id", "name", "pool", "pool_id", "shared", "owned", "hostname", "state", "cpu_milli", "memory_mb",
                  "labels", "last_heartbeat_at", "agent_version", "job_isolation", "gpus"]

    def get_owned(self, node: Node) -> bool:
        return node.pool.tenant_id == _caller_tenant_id(self.context)

    def get_shared(self, node: Node) -> bool:
        if node.pool.tenant_id != _caller_tenant_id(self.context):
            return True
        return bool(getattr(node, "pool_has_grants", False))

    def get_labels(self, node: Node) -> dict[str, str]:
        # Only valid pairs: rows stored before agent labels were validated may hold keys that
        # cannot even be rendered (a lone surrogate answered 500 for the whole node list).
        return valid_labels(node.labels)

    def get_job_isolation(self, node: Node) -> str | None:
        agent = getattr(node, "agent", None)  # a reverse one-to-one: absent for nodes without an agent
        return (agent.job_isolation or None) if agent is not None else None


def _usable_pools(request):
    ctx = tenant_context(request)
    return pools_usable_by(ctx.tenant) if ctx is not None else Pool.objects.none()


class NodeFilter(django_filters.FilterSet):
    state = django_filters.ChoiceFilter(choices=NodeState.choices)
    # Only pools the caller may use are valid choices: another tenant's pool id answers exactly like an
    # unknown one.
    pool = django_filters.ModelChoiceFilter(queryset=_usable_pools)

    class Meta:
        model = Node
        fields = ["state", "pool"]


class NodeViewSet(TenantReadOnlyViewSet):
    """Nodes the team may use: of its own pools and of pools shared with it. Read-only for everyone: the
    API has no node write actions (draining, giving up, join tokens are for platform operators)."""

    queryset = Node.objects.select_related("pool", "agent").annotate(
        pool_has_grants=Exists(PoolGrant.objects.filter(pool=OuterRef("pool_id")))).prefetch_related(
        # Active slices only (what holds each GPU now), with their job's id and team for `held_by`.
        Prefetch("gpus__slices", queryset=AllocationSlice.objects.filter(active=True)
                 .select_related("allocation__job").only("id", "gpu_id", "active", "allocation__id",
                                                         "allocation__job__id", "allocation__job__tenant_id")))
    serializer_class = NodeSerializer
    lookup_value_regex = "[0-9]+"  # ASCII digits only: `\d` and int() also take "²" or "٣"
    filterset_class = NodeFilter
    schema = WhaleZenAutoSchema()

    def scope(self, queryset: QuerySet) -> QuerySet:
        return queryset.filter(pk__in=nodes_usable_by(self.ctx.tenant).values("pk"))


class TeamQuotaOutSerializer(serializers.Serializer):
    flavor = serializers.CharField(help_text='A GPU model name, or "CU" (compute units over all models)')
    nominal = serializers.FloatField(help_text="Guaranteed owned capacity")
    borrowing_limit = serializers.FloatField(allow_null=True, help_text="Most above nominal; null = no limit")
    lending_limit = serializers.FloatField(allow_null=True, help_text="Most of the unused nominal others may "
                                                                      "borrow; null = all of it")
    in_use = serializers.FloatField(help_text="What the team's jobs hold now on owned nodes")
    borrowed = serializers.FloatField(help_text="max(0, in_use - nominal)")
    decayed_usage_hours = serializers.FloatField(help_text="Past GPU-hours (CU-hours) decayed by the half-life")


class QuotaSerializer(serializers.Serializer):
    tenant = serializers.CharField()
    max_gpus = serializers.IntegerField()
    max_compute_units = serializers.FloatField()
    monthly_budget_usd = serializers.FloatField(allow_null=True)
    max_pending_jobs = serializers.IntegerField()
    usage = serializers.DictField()
    quotas = TeamQuotaOutSerializer(many=True)
    fair_share_factor = serializers.FloatField(
        allow_null=True, help_text="2^(-dominant share), 1 = used nothing of its entitlement (docs/quotas.md); "
                                   "null when no quota applies")


class QuotaView(APIView):
    schema = WhaleZenAutoSchema()

    @extend_schema(responses={200: QuotaSerializer})
    def get(self, request: Request) -> Response:
        tenant = tenant_context(request).tenant
        quota, _ = Quota.objects.get_or_create(tenant=tenant)
        shared = team_quota_usage(tenant=tenant)
        return Response({
            "tenant": tenant.slug,
            "max_gpus": quota.max_gpus,
            "max_compute_units": float(quota.max_compute_units),
            "monthly_budget_usd": float(quota.monthly_budget_usd) if quota.monthly_budget_usd is not None else None,
            "max_pending_jobs": quota.max_pending_jobs,
            "usage": tenant_gpu_usage(tenant=tenant),
            "quotas": shared.quotas,
            "fair_share_factor": shared.fair_share_factor,
        })
