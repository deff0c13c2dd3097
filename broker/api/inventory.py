"""/api/v1/gpu-models/, /pools/, /nodes/, /quota/: what a tenant can run on, and its limits."""
from __future__ import annotations

import django_filters
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from broker.api.base import TenantReadOnlyViewSet
from broker.api.schema import WhaleZenAutoSchema
from broker.inventory.labels import valid_labels
from broker.inventory.models import Gpu, GpuModel, Node, NodeState, Pool
from broker.jobs.selectors import tenant_gpu_usage
from broker.tenancy.models import Quota
from broker.tenancy.permissions import tenant_context


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


class PoolSerializer(serializers.ModelSerializer):
    node_count = serializers.IntegerField(source="nodes.count", read_only=True)

    class Meta:
        model = Pool
        fields = ["id", "name", "kind", "region", "gpu_hour_rate_usd", "marginal_cost_usd_per_gpu_hour", "enabled",
                  "node_count", "created_at"]


class PoolViewSet(TenantReadOnlyViewSet):
    queryset = Pool.objects.all()
    serializer_class = PoolSerializer
    lookup_value_regex = "[0-9]+"  # ASCII digits only: `\d` and int() also take "²" or "٣"
    schema = WhaleZenAutoSchema()


class GpuSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model_name")
    in_use = serializers.SerializerMethodField()

    class Meta:
        model = Gpu
        fields = ["index", "uuid", "model", "memory_mb", "nvlink_island", "numa_node", "pci_bus_id", "mig_mode",
                  "health", "utilization_pct", "memory_used_mb", "temperature_c", "power_w", "ecc_errors",
                  "last_seen_at", "in_use"]

    def get_in_use(self, gpu: Gpu) -> float:
        """Share of the GPU held by allocations, 0..1."""
        return round(sum(1 for s in gpu.slices.all() if s.active) / Gpu.SLOTS, 3)


class NodeSerializer(serializers.ModelSerializer):
    pool = serializers.CharField(source="pool.name")
    gpus = GpuSerializer(many=True, read_only=True)
    labels = serializers.SerializerMethodField()
    job_isolation = serializers.SerializerMethodField(
        help_text='How its agent runs jobs: "separate-user", or "shared-user" (jobs could read the agent\'s '
                  'secrets); null when the agent did not say.')

    class Meta:
        model = Node
        fields = ["id", "name", "pool", "hostname", "state", "cpu_milli", "memory_mb", "labels",
                  "last_heartbeat_at", "agent_version", "job_isolation", "gpus"]

    def get_labels(self, node: Node) -> dict[str, str]:
        # Only valid pairs: rows stored before agent labels were validated may hold keys that
        # cannot even be rendered (a lone surrogate answered 500 for the whole node list).
        return valid_labels(node.labels)

    def get_job_isolation(self, node: Node) -> str | None:
        agent = getattr(node, "agent", None)  # a reverse one-to-one: absent for nodes without an agent
        return (agent.job_isolation or None) if agent is not None else None


def _own_pools(request):
    ctx = tenant_context(request)
    return Pool.objects.filter(tenant=ctx.tenant) if ctx is not None else Pool.objects.none()


class NodeFilter(django_filters.FilterSet):
    state = django_filters.ChoiceFilter(choices=NodeState.choices)
    # Only the caller's pools are valid choices: another tenant's pool id answers exactly like an unknown one.
    pool = django_filters.ModelChoiceFilter(queryset=_own_pools)

    class Meta:
        model = Node
        fields = ["state", "pool"]


class NodeViewSet(TenantReadOnlyViewSet):
    queryset = Node.objects.select_related("pool", "agent").prefetch_related("gpus__slices")
    serializer_class = NodeSerializer
    lookup_value_regex = "[0-9]+"  # ASCII digits only: `\d` and int() also take "²" or "٣"
    filterset_class = NodeFilter
    schema = WhaleZenAutoSchema()


class QuotaSerializer(serializers.Serializer):
    tenant = serializers.CharField()
    max_gpus = serializers.IntegerField()
    max_compute_units = serializers.FloatField()
    monthly_budget_usd = serializers.FloatField(allow_null=True)
    max_pending_jobs = serializers.IntegerField()
    usage = serializers.DictField()


class QuotaView(APIView):
    schema = WhaleZenAutoSchema()

    @extend_schema(responses={200: QuotaSerializer})
    def get(self, request: Request) -> Response:
        tenant = tenant_context(request).tenant
        quota, _ = Quota.objects.get_or_create(tenant=tenant)
        return Response({
            "tenant": tenant.slug,
            "max_gpus": quota.max_gpus,
            "max_compute_units": float(quota.max_compute_units),
            "monthly_budget_usd": float(quota.monthly_budget_usd) if quota.monthly_budget_usd is not None else None,
            "max_pending_jobs": quota.max_pending_jobs,
            "usage": tenant_gpu_usage(tenant=tenant),
        })
