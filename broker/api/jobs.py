"""/api/v1/jobs/: submit, list, show, events, cancel."""
from __future__ import annotations

from datetime import timezone as dt_timezone

import django_filters
from django import forms
from django_filters.fields import IsoDateTimeField
from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from broker.api.base import TenantScopedMixin
from broker.api.fields import PrebuiltFieldsMixin, StrictCharField, StrictSerializer
from broker.api.schema import CONFLICT, THROTTLED, WhaleZenAutoSchema
from broker.api.throttles import JobSubmitThrottle
from broker.jobs import services
from broker.jobs import checkpoints
from broker.jobs.migration import migration_phases, migration_request
from broker.jobs.models import Checkpoint, Job, JobEvent, Migration
from broker.jobs import intake
from broker.jobs.formats import FORMATS
from broker.jobs.spec import JobSpecSerializer, spec_to_json
from broker.jobs.states import JobState


class AllocationOutSerializer(serializers.Serializer):
    id = serializers.IntegerField(help_text="The assignment id the node's agent and the job's log folder use.")
    node = serializers.CharField(source="node.name")
    gpus = serializers.SerializerMethodField()
    epoch = serializers.IntegerField()

    def get_gpus(self, alloc) -> list[int]:
        return sorted({s.gpu.index for s in alloc.slices.all() if s.active})


class PendingReasonSerializer(serializers.Serializer):
    code = serializers.CharField(source="pending_reason_code")
    message = serializers.CharField(source="pending_reason")
    data = serializers.JSONField(source="pending_reason_data")


class JobSerializer(PrebuiltFieldsMixin, serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    demand = serializers.SerializerMethodField()
    pending_reason = serializers.SerializerMethodField()
    allocations = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = ["id", "name", "state", "priority", "preemptible", "owner", "spec", "demand",
                  "pending_reason", "allocations", "created_at", "updated_at", "started_at", "finished_at"]
        read_only_fields = fields

    def get_demand(self, job: Job) -> dict:
        return {
            "gpus_per_node": job.gpu_count, "nodes": job.node_count, "total_gpus": job.gpu_count * job.node_count,
            "gpu_milli": job.gpu_milli,
            "compute_units": float(job.compute_units) if job.compute_units is not None else None,
            "gpu_models": job.gpu_models, "gpu_alternatives": job.gpu_alternatives,
            "min_gpu_memory_gb": job.min_gpu_memory_gb,
            "interconnect": job.interconnect, "cpu_milli": job.cpu_milli, "memory_mb": job.memory_mb,
            "spot": job.spot,
            "max_price_per_hour": float(job.max_price_per_hour) if job.max_price_per_hour is not None else None,
            "expected_duration_hours": job.expected_duration_hours,
        }

    # Both as plain dicts, in the shape of PendingReasonSerializer and AllocationOutSerializer: a nested
    # serializer built per job of a page was a third of the jobs list's time.
    def get_pending_reason(self, job: Job) -> dict | None:
        if job.state != JobState.PENDING:
            return None
        return {"code": job.pending_reason_code, "message": job.pending_reason, "data": job.pending_reason_data}

    def get_allocations(self, job: Job) -> list[dict]:
        if self.context.get("just_submitted"):  # nothing holds GPUs for it yet: no query
            return []
        return [{"id": a.id, "node": a.node.name, "gpus": sorted({s.gpu.index for s in a.slices.all() if s.active}),
                 "epoch": a.epoch} for a in job.allocations.all() if a.active]


class SubmitQuerySerializer(PrebuiltFieldsMixin, StrictSerializer):
    dry_run = serializers.BooleanField(required=False, help_text="1: validate and normalise only; nothing is created.")
    # Not `format`: DRF reads ?format= as the response renderer (the costs API's ?format=csv).
    spec_format = serializers.ChoiceField(choices=FORMATS, required=False,
                                          help_text="How the body is written; detected from its shape when left out.")


class FieldRemarkSerializer(serializers.Serializer):
    field = serializers.CharField()
    message = serializers.CharField()


class DryRunSerializer(serializers.Serializer):
    dry_run = serializers.BooleanField()
    format = serializers.ChoiceField(choices=FORMATS)
    spec = serializers.JSONField(help_text="The native spec the submission would store.")
    demand = serializers.JSONField(help_text="What the scheduler would read.")
    warnings = FieldRemarkSerializer(many=True, help_text="Fields accepted that do not change a batch run.")
    problems = FieldRemarkSerializer(many=True, help_text="What would still block a real submission.")


class JobEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = JobEvent
        fields = ["id", "created_at", "kind", "reason_code", "message", "data"]


class CheckpointOutSerializer(serializers.ModelSerializer):
    written_on = serializers.CharField(source="allocation.node.name", default=None, read_only=True)

    class Meta:
        model = Checkpoint
        fields = ["id", "step", "state", "size_bytes", "uri", "created_at", "committed_at", "request_id",
                  "problem", "written_on"]


class MigrationOutSerializer(serializers.ModelSerializer):
    source = serializers.CharField(source="source_node", read_only=True)
    target = serializers.SerializerMethodField()
    to = serializers.CharField(source="placed_on", read_only=True)
    downtime_s = serializers.FloatField(source="downtime_seconds", read_only=True, allow_null=True)
    phases = serializers.SerializerMethodField()
    restored_step = serializers.IntegerField(source="checkpoint.step", default=None, read_only=True)

    class Meta:
        model = Migration
        fields = ["id", "cause", "state", "source", "target", "to", "downtime_s", "phases", "restored_step",
                  "outcome", "requested_at", "finished_at"]

    def get_target(self, migration: Migration) -> str:
        return migration.target_node or (f"pool {migration.target_pool}" if migration.target_pool else "anywhere")

    def get_phases(self, migration: Migration) -> dict[str, float | None]:
        return migration_phases(migration)


class MigrateRequestSerializer(StrictSerializer):
    node = StrictCharField(required=False, max_length=200, help_text="Move to this node (a name).")
    pool = StrictCharField(required=False, max_length=200, help_text="Move into this pool (a name).")


class UtcIsoDateTimeField(IsoDateTimeField):
    """An ISO 8601 time that must exist in UTC: `9999-12-31T23:59:59-14:00` is a 400, not a database error."""

    def clean(self, value):
        value = super().clean(value)
        if value is not None:
            try:
                value = value.astimezone(dt_timezone.utc)
            except OverflowError:
                raise forms.ValidationError("Out of range once converted to UTC.", code="invalid") from None
        return value


class UtcIsoDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UtcIsoDateTimeField


class JobFilter(django_filters.FilterSet):
    # No join to deduplicate: without distinct=False the filter adds SELECT DISTINCT over every column
    # (the spec JSON included) to the page and its count.
    state = django_filters.MultipleChoiceFilter(choices=JobState.choices, distinct=False)
    name = django_filters.CharFilter(lookup_expr="icontains")
    priority = django_filters.NumberFilter()
    priority_min = django_filters.NumberFilter(field_name="priority", lookup_expr="gte")
    priority_max = django_filters.NumberFilter(field_name="priority", lookup_expr="lte")
    created_after = UtcIsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = UtcIsoDateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = Job
        fields = ["state", "name", "priority"]


EXAMPLE_SPEC = {
    "name": "llama-finetune",
    "command": ["python", "train.py", "--epochs", "3"],
    "image": "ghcr.io/acme/trainer:1.4",
    "priority": "high",
    "preemptible": True,
    "expected_duration_hours": 6,
    "resources": {"gpus": 4, "gpu_models": ["A100-80GB", "H100-80GB"], "interconnect": "nvlink",
                  "cpu": 32, "memory_gb": 256},
    "placement": {"providers": ["onprem", "aws"], "spot": "allowed", "max_price_per_hour": 30},
    "checkpoint": {"uri": "s3://acme-ckpt/llama", "interval_minutes": 30},
}


class JobViewSet(TenantScopedMixin, mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                 viewsets.GenericViewSet):
    # Newest first by id, which is submission order (created_at is set at insert): SQLite walks the
    # (tenant) index, which holds rowids in order, instead of sorting every job of the tenant by
    # created_at for each page (225 ms a page at 100,000 jobs, bench/service.py --parts reads).
    queryset = (Job.objects.select_related("owner").prefetch_related("allocations__slices__gpu", "allocations__node")
                .order_by("-id"))
    serializer_class = JobSerializer
    filterset_class = JobFilter
    lookup_value_regex = "[0-9]+"  # ASCII digits only: `\d` and int() also take "²" or "٣"
    schema = WhaleZenAutoSchema()
    # Members cancel (and later move or checkpoint) only their own jobs: IsTenantMember.has_object_permission.
    owner_field = "owner"

    def get_throttles(self):
        if self.action == "create":
            return [JobSubmitThrottle()]
        return super().get_throttles()

    @extend_schema(request=JobSpecSerializer, responses={201: JobSerializer, 200: DryRunSerializer, 429: THROTTLED},
                   parameters=[SubmitQuerySerializer],
                   examples=[OpenApiExample("4 x A100 on NVLink", value=EXAMPLE_SPEC, request_only=True)],
                   description="Submit a job spec: WhaleZen's own, a SkyPilot task file or a Kubernetes Pod / "
                               "batch/v1 Job / Pod template (JSON, or YAML with Content-Type: application/yaml). "
                               "`?dry_run=1` validates and normalises without creating anything (200).")
    def create(self, request: Request, *args, **kwargs) -> Response:
        query = SubmitQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        submission = intake.submission_parse(request.data, tenant=self.ctx.tenant,
                                             declared=query.validated_data.get("spec_format"))
        warnings = [w.as_dict() for w in submission.warnings]
        if query.validated_data.get("dry_run"):
            return Response({"dry_run": True, "format": submission.format,
                             "spec": spec_to_json(submission.validated), "demand": submission.demand.as_dict(),
                             "warnings": warnings, "problems": [p.as_dict() for p in submission.problems]},
                            status=status.HTTP_200_OK)
        intake.submission_refuse_problems(submission)
        job = services.job_submit(tenant=self.ctx.tenant, owner=request.user, validated=submission.validated)
        # The answer is the row job_submit wrote (its owner is the caller), not the row read back: that
        # read, with the list's joins and prefetches, was a fifth of a submission's time. It is the job as
        # submitted, PENDING with no allocations: a cycle that places it a moment later shows on the next GET.
        return Response({**JobSerializer(job, context={"just_submitted": True}).data, "format": submission.format,
                         "warnings": warnings}, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: JobEventSerializer(many=True)}, filters=False)
    @action(detail=True, methods=["get"])
    def events(self, request: Request, pk: str | None = None) -> Response:
        job = self.get_object()
        page = self.paginate_queryset(JobEvent.objects.filter(job=job).order_by("created_at", "id"))
        return self.get_paginated_response(JobEventSerializer(page, many=True).data)

    @extend_schema(request=None, responses={200: CheckpointOutSerializer(many=True)}, filters=False)
    @action(detail=True, methods=["get"])
    def checkpoints(self, request: Request, pk: str | None = None) -> Response:
        """The job's checkpoints, newest first: PENDING (being verified), COMMITTED (a restart resumes
        from the newest), INVALID (failed verification, never restored) or DELETED (pruned)."""
        job = self.get_object()
        page = self.paginate_queryset(Checkpoint.objects.filter(job=job).select_related("allocation__node")
                                      .order_by("-step", "-id"))
        return self.get_paginated_response(CheckpointOutSerializer(page, many=True).data)

    @extend_schema(request=None, responses={202: JobSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def checkpoint(self, request: Request, pk: str | None = None) -> Response:
        """Ask the running job for a checkpoint now. 202: the request is on its way (the job is
        CHECKPOINTING until one is committed, or the request times out and it runs on)."""
        job = self.get_object()
        checkpoints.checkpoint_request(job=job, reason_code="USER_CHECKPOINT",
                                       message=f"Checkpoint requested by {request.user}.")
        return Response(JobSerializer(self.get_queryset().get(pk=job.pk)).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=MigrateRequestSerializer, responses={202: MigrationOutSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def migrate(self, request: Request, pk: str | None = None) -> Response:
        """Move the running job by checkpoint: to a node, into a pool, or (no body) anywhere else.
        202: the move has begun (GET .../migrations/ follows it). 409 when the job is not running, has
        no checkpoint.uri, is being moved already, or the target has no room (the reason says why)."""
        job = self.get_object()
        body = MigrateRequestSerializer(data=request.data or {})
        body.is_valid(raise_exception=True)
        migration = migration_request(job=job, target_node=body.validated_data.get("node", ""),
                                      target_pool=body.validated_data.get("pool", ""),
                                      message="")
        return Response(MigrationOutSerializer(migration).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={200: MigrationOutSerializer(many=True)}, filters=False)
    @action(detail=True, methods=["get"])
    def migrations(self, request: Request, pk: str | None = None) -> Response:
        """The job's moves, newest first: cause, from, to, downtime and its phases, outcome."""
        job = self.get_object()
        page = self.paginate_queryset(Migration.objects.filter(job=job).select_related("checkpoint"))
        return self.get_paginated_response(MigrationOutSerializer(page, many=True).data)

    @extend_schema(request=None, responses={200: JobSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        job = self.get_object()
        services.job_cancel(job=job, by=request.user)
        return Response(JobSerializer(self.get_queryset().get(pk=job.pk)).data)
