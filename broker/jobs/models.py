"""Jobs, their event log, the GPUs they hold, and their checkpoints."""
from __future__ import annotations

from typing import Iterable

from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django.db.models.lookups import GreaterThan
from django.utils import timezone

from broker.inventory.models import Gpu, Node
from broker.jobs.states import JobState
from broker.tenancy.models import Tenant


class Interconnect(models.TextChoices):
    ANY = "any", "Any"
    PCIE = "pcie", "PCIe (same node)"
    NVLINK = "nvlink", "NVLink island"


class SpotPolicy(models.TextChoices):
    NEVER = "never", "Never"
    ALLOWED = "allowed", "Allowed"
    REQUIRED = "required", "Required"


class Job(models.Model):
    """A GPU job. `spec` is what the user sent (normalised); the demand columns are what the scheduler reads."""

    # No index of its own: the composite indexes below lead with the team, and each index is written again
    # on every state change (5,000 a cycle; bench.service).
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="jobs", db_index=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=200)
    spec = models.JSONField()
    # Secret env values (SkyPilot `secrets`): handed to the job's processes, never shown in the spec,
    # events or logs.
    secret_env = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.PENDING)
    priority = models.IntegerField(default=50)
    preemptible = models.BooleanField(default=False)

    # Normalised demand.
    gpu_count = models.PositiveIntegerField(default=0, help_text="GPUs per node")
    gpu_milli = models.PositiveIntegerField(default=1000, help_text="Share of each GPU, 1000 = whole")
    compute_units = models.DecimalField(max_digits=10, decimal_places=3, null=True, blank=True)
    gpu_models = models.JSONField(default=list, blank=True)
    # Accelerator alternatives with their own counts, {model: GPUs per node} (SkyPilot's
    # {L4:8, A100-80GB:2}); empty when every allowed model takes gpu_count.
    gpu_alternatives = models.JSONField(default=dict, blank=True)
    min_gpu_memory_gb = models.PositiveIntegerField(default=0)
    interconnect = models.CharField(max_length=8, choices=Interconnect.choices, default=Interconnect.ANY)
    node_count = models.PositiveIntegerField(default=1)
    cpu_milli = models.PositiveIntegerField(default=0)
    memory_mb = models.PositiveIntegerField(default=0)
    spot = models.CharField(max_length=8, choices=SpotPolicy.choices, default=SpotPolicy.NEVER)
    max_price_per_hour = models.DecimalField(max_digits=10, decimal_places=4, null=True, blank=True)
    expected_duration_hours = models.FloatField(null=True, blank=True)
    deadline = models.DateTimeField(null=True, blank=True)

    # Why a pending job waits (set by the scheduler).
    pending_reason_code = models.CharField(max_length=48, blank=True)
    pending_reason = models.TextField(blank=True)
    pending_reason_data = models.JSONField(default=dict, blank=True)

    next_attempt_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        # The jobs list is a team's jobs newest first by id, optionally of one state (broker/api/jobs.py):
        # with the id in the index, a page (deep ones too: OFFSET) is read from the index alone.
        indexes = [
            models.Index(fields=["tenant", "state", "id"], name="job_tenant_state_id"),
            models.Index(fields=["tenant", "id"], name="job_tenant_id"),
            models.Index(fields=["state", "priority"]),
        ]
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"job {self.pk} {self.name} ({self.state})"

    @property
    def checkpoint_uri(self) -> str:
        """Where the job writes checkpoints (`checkpoint.uri` of its spec), or "" for a job without."""
        return ((self.spec or {}).get("checkpoint") or {}).get("uri") or ""


class JobEvent(models.Model):
    """Append-only log of what happened to a job."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    kind = models.CharField(max_length=32)
    reason_code = models.CharField(max_length=48, blank=True)
    message = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"{self.kind} {self.reason_code}"


class Allocation(models.Model):
    """The GPUs (or GPU slices) one job holds on one node. A gang job has one allocation per node."""

    # Indexed by Meta's composites, which lead with each (a single-column index too was one more write
    # per allocation, 5,000 a cycle).
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="allocations", db_index=False)
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="allocations", db_index=False)
    active = models.BooleanField(default=True)
    epoch = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    released_at = models.DateTimeField(null=True, blank=True)
    # Released without word from its agent (the node was LOST): its process may still run. The
    # job's next start waits until that copy is confirmed stopped or WHALEZEN_FENCE_WAIT_SECONDS
    # pass (broker.agents.fencing), so a job never runs twice at once.
    stop_unconfirmed = models.BooleanField(default=False)

    class Meta:
        indexes = [models.Index(fields=["node", "active"]),
                   models.Index(fields=["job", "stop_unconfirmed"], name="jobs_alloc_job_unconfirmed")]

    def __str__(self) -> str:
        return f"alloc {self.pk} job {self.job_id} on {self.node_id}"


class AllocationSlice(models.Model):
    """The slots of one GPU held by one allocation: one row per (allocation, GPU), its slots as a bit mask.

    Double-booking is impossible in the database: one partial unique index per slot k
    (`one_active_holder_gpu_slot_k`) holds the GPU of every active row whose mask has bit k, so two active
    rows can share a GPU only with disjoint masks, on PostgreSQL and SQLite alike. It was one row per slot
    under one unique (gpu, slot) index: ten rows per whole GPU, about 45,000 for a 5,000-placement cycle
    (bench.service: the commit of that cycle 1.13 -> 1.00 s, its snapshot 0.29 -> 0.24 s with one row per
    GPU); a whole GPU is one row now, entered in the ten indexes.

    The two foreign keys are not database constraints (`db_constraint=False`; the ORM still cascades
    and protects as declared): PostgreSQL checked both keys of every row at commit. No check is lost
    that could fail: rows are written only by `allocation_commit` and `placements_commit`, in the
    transaction that inserts their allocation, naming GPU rows read under their node's lock; the
    service deletes no GPU or allocation, and a delete through the ORM (the admin) still cascades or
    is refused."""

    allocation = models.ForeignKey(Allocation, on_delete=models.CASCADE, related_name="slices", db_constraint=False)
    # Indexed for active rows only (`slice_active_gpu`): every read by GPU asks for active slots; a GPU is
    # deleted only by hand (the admin's PROTECT check then scans the table).
    gpu = models.ForeignKey(Gpu, on_delete=models.PROTECT, related_name="slices", db_constraint=False,
                            db_index=False)
    mask = models.PositiveSmallIntegerField()  # bit k set: slot k of Gpu.SLOTS is held
    slots = models.PositiveSmallIntegerField()  # how many bits `mask` has: what shares and quotas count
    active = models.BooleanField(default=True)

    class Meta:
        # What holds a GPU now. The unique indexes below cannot answer that: each also asks for its slot's bit.
        indexes = [models.Index(fields=["gpu"], condition=Q(active=True), name="slice_active_gpu")]
        constraints = [
            models.UniqueConstraint(fields=["gpu"], name=f"one_active_holder_gpu_slot_{slot}",
                                    condition=Q(GreaterThan(F("mask").bitand(1 << slot), 0), active=True))
            for slot in range(Gpu.SLOTS)
        ] + [  # a row holds some slot, and only slots that an index above guards
            models.CheckConstraint(condition=Q(mask__gte=1, mask__lt=1 << Gpu.SLOTS), name="slice_mask_in_range"),
        ]

    @staticmethod
    def mask_of(slots: Iterable[int]) -> int:
        return sum(1 << slot for slot in set(slots))

    @staticmethod
    def slots_of(mask: int) -> list[int]:
        return [slot for slot in range(Gpu.SLOTS) if mask >> slot & 1]


class CheckpointState(models.TextChoices):
    PENDING = "PENDING", "Being written"
    COMMITTED = "COMMITTED", "Committed"
    INVALID = "INVALID", "Invalid"
    DELETED = "DELETED", "Deleted"


class Checkpoint(models.Model):
    """One checkpoint a job wrote (agent/checkpoint): PENDING until the broker has re-read every file
    against its manifest, then COMMITTED (restorable) or INVALID (never restored). Older committed
    ones beyond the newest two are DELETED from storage."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    # The run that wrote it (None for rows older than the agent's reports).
    allocation = models.ForeignKey("Allocation", on_delete=models.SET_NULL, null=True, blank=True,
                                   related_name="checkpoints")
    uri = models.CharField(max_length=1024)  # the checkpoint's own directory: <spec uri>/step-NNNNNNNNNNNN
    step = models.BigIntegerField(default=0)
    manifest = models.JSONField(default=dict, blank=True)
    manifest_sha256 = models.CharField(max_length=64, blank=True)
    request_id = models.CharField(max_length=128, blank=True)  # the broker's request it answered, if any
    size_bytes = models.BigIntegerField(null=True, blank=True)
    problem = models.TextField(blank=True)  # why it is INVALID
    state = models.CharField(max_length=16, choices=CheckpointState.choices, default=CheckpointState.PENDING)
    created_at = models.DateTimeField(auto_now_add=True)
    committed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [models.UniqueConstraint(fields=["job", "uri", "manifest_sha256"],
                                               name="one_row_per_written_checkpoint")]
        indexes = [models.Index(fields=["job", "state", "step"], name="jobs_ckpt_job_state_step")]


class MigrationCause(models.TextChoices):
    REQUESTED = "REQUESTED", "Requested by a user"
    PREEMPTION = "PREEMPTION", "Preemption"
    DEFRAGMENTATION = "DEFRAGMENTATION", "Defragmentation"
    CONSOLIDATION = "CONSOLIDATION", "Consolidation onto cheaper capacity"
    SPOT = "SPOT", "Spot interruption"


class MigrationState(models.TextChoices):
    CHECKPOINTING = "CHECKPOINTING", "Waiting for a committed checkpoint"
    STOPPING = "STOPPING", "Stopping (fencing) the source"
    PLACING = "PLACING", "Placing and starting on the target"
    COMPLETED = "COMPLETED", "Running on the target"
    ROLLED_BACK = "ROLLED_BACK", "Called off; the job runs where it was"
    ABANDONED = "ABANDONED", "The job ended during the move"


class Migration(models.Model):
    """One move of a running job by checkpoint (broker.jobs.migration): checkpoint, fence the source,
    place on the target, restore. At most one open move per job."""

    OPEN_STATES = (MigrationState.CHECKPOINTING, MigrationState.STOPPING, MigrationState.PLACING)
    # Moves that end in the queue (the scheduler places the job again) rather than on a chosen target.
    REQUEUE_CAUSES = (MigrationCause.PREEMPTION, MigrationCause.SPOT)

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="migrations")
    cause = models.CharField(max_length=24, choices=MigrationCause.choices)
    state = models.CharField(max_length=16, choices=MigrationState.choices, default=MigrationState.CHECKPOINTING)
    source_allocation = models.ForeignKey(Allocation, on_delete=models.SET_NULL, null=True, related_name="+")
    source_node = models.CharField(max_length=200)
    target_node = models.CharField(max_length=200, blank=True)  # as asked; blank = anywhere else
    target_pool = models.CharField(max_length=200, blank=True)
    placed_on = models.CharField(max_length=200, blank=True)  # where it went
    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.SET_NULL, null=True, related_name="+")
    outcome = models.TextField(blank=True)
    # By when the checkpoint must be committed: a user's move is called off after it, a preemption or
    # spot move requeues the job anyway (losing the work since its last committed checkpoint).
    deadline = models.DateTimeField(null=True, blank=True)
    requested_at = models.DateTimeField(auto_now_add=True)
    checkpointed_at = models.DateTimeField(null=True, blank=True)
    source_stopped_at = models.DateTimeField(null=True, blank=True)
    running_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-requested_at", "-id"]
        constraints = [models.UniqueConstraint(
            fields=["job"], condition=Q(state__in=["CHECKPOINTING", "STOPPING", "PLACING"]),
            name="one_open_migration_per_job")]

    @property
    def downtime_seconds(self) -> float | None:
        """How long the job did not run: from its source being told to stop to running on the target."""
        if self.checkpointed_at is None or self.running_at is None:
            return None
        return max(0.0, (self.running_at - self.checkpointed_at).total_seconds())


class UploadKind(models.TextChoices):
    TREE = "tree", "A folder (unpacked into the destination)"
    FILE = "file", "One file (written at the destination)"


class Upload(models.Model):
    """A tar.gz sent with a submission (a SkyPilot workdir or local file_mounts source), named by jobs'
    `files` as `upload:<id>`. The blob is on disk, never in the database (broker/jobs/uploads.py)."""

    id = models.CharField(primary_key=True, max_length=32, editable=False)  # 32 random hex digits
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="uploads")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="uploads")
    kind = models.CharField(max_length=8, choices=UploadKind.choices, default=UploadKind.TREE)
    sha256 = models.CharField(max_length=64)
    size_bytes = models.PositiveBigIntegerField()
    unpacked_bytes = models.PositiveBigIntegerField(default=0)
    members = models.PositiveIntegerField(default=0)
    # When it was (last) sent: the expiry counts from here. Not auto_now_add: sending the same archive
    # again moves it.
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "sha256"])]

    def __str__(self) -> str:
        return f"upload {self.id} ({self.size_bytes} bytes)"
