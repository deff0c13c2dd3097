"""Billing: usage records (append-only, one per allocation per UTC day), the price fixed when an
allocation started, per-model chargeback rates, frozen monthly statements and budget alerts.

The rules (docs in README.md, "Billing and cost reports"; arithmetic in broker/billing/metering.py):
- A record is one allocation's GPUs held during one UTC day (or an instance's idle capacity that day),
  whole seconds from hold to release, at the rate fixed when the allocation was committed.
- amount = gpus x seconds / 3600 x rate, rounded ONCE to the cent with ROUND_HALF_EVEN, plus (owned pools
  with CPU/memory rates) the CPU and memory amounts, each rounded once the same way. Every total
  (a statement, a cost report row, a budget's spend) is the sum of such amounts, so totals add up to
  the cent whatever the grouping.
- Records are never updated or deleted (save() and delete() refuse it); a unique `key` makes writing
  them idempotent (two metering runs at once insert each record once).
"""
from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.db import models

from broker.jobs.models import Allocation
from broker.tenancy.models import Tenant

IDLE = "__idle__"


class AppendOnly(Exception):
    """A usage record or a closed statement was about to be changed."""


class UsageKind(models.TextChoices):
    USAGE = "usage", "GPUs held by a job"
    IDLE = "idle", "Rented capacity nobody held"


class AllocationMeter(models.Model):
    """The price an allocation pays, fixed as its commit completed (or by the next metering run), and its
    GPU utilisation sampled by each metering run while it was held."""

    allocation = models.OneToOneField(Allocation, on_delete=models.CASCADE, related_name="meter")
    rate_usd_per_gpu_hour = models.DecimalField(max_digits=14, decimal_places=6)
    rate_source = models.CharField(max_length=16, help_text='"instance", "pool" or "pool_model"')
    spot = models.BooleanField(default=False)
    # The owned pool's CPU and memory rates as they stood (null: not charged; always null on a rented
    # instance, whose price covers them).
    cpu_rate_usd_per_core_hour = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    memory_rate_usd_per_gib_hour = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    fixed_at = models.DateTimeField()
    util_sum = models.FloatField(default=0.0)
    util_samples = models.PositiveIntegerField(default=0)
    last_sampled_at = models.DateTimeField(null=True, blank=True)
    # Every line of the allocation is written (it was released and its last day recorded): metering
    # and live reports skip it from then on.
    complete = models.BooleanField(default=False, db_index=True)

    @property
    def avg_utilisation(self) -> float | None:
        return self.util_sum / self.util_samples if self.util_samples else None


class InstanceMeter(models.Model):
    """Whether every idle line of a rented instance is written (it is terminated and recorded)."""

    instance = models.OneToOneField("inventory.CloudInstance", on_delete=models.CASCADE, related_name="meter")
    complete = models.BooleanField(default=False, db_index=True)


class ChargebackRate(models.Model):
    """An owned pool's chargeback price for one GPU model, overriding the pool's gpu_hour_rate_usd."""

    pool = models.ForeignKey("inventory.Pool", on_delete=models.CASCADE, related_name="chargeback_rates")
    gpu_model = models.CharField(max_length=64)
    rate_usd_per_gpu_hour = models.DecimalField(max_digits=14, decimal_places=6)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["pool", "gpu_model"], name="uniq_chargeback_rate")]


class UsageRecord(models.Model):
    """One line of the bill: what one allocation held during one UTC day, or one rented instance's idle
    capacity that day (`kind=idle`, job and user "__idle__"). Denormalised so reports need no joins."""

    key = models.CharField(max_length=80, unique=True,
                           help_text='"alloc:<allocation id>:<day>" or "idle:<instance id>:<day>"')
    kind = models.CharField(max_length=8, choices=UsageKind.choices)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="usage_records")
    month = models.CharField(max_length=7, help_text="YYYY-MM (UTC)")
    day = models.DateField()
    job_id = models.BigIntegerField(null=True, blank=True)
    job_name = models.CharField(max_length=200, blank=True)
    user = models.CharField(max_length=150, help_text='username of the job owner, or "__idle__"')
    allocation_id = models.BigIntegerField(null=True, blank=True)
    instance_id = models.BigIntegerField(null=True, blank=True)
    node = models.CharField(max_length=200, blank=True)
    gpu_model = models.CharField(max_length=64, blank=True)
    provider = models.CharField(max_length=16, help_text="the pool's kind: onprem, aws, gcp, local")
    pool = models.CharField(max_length=200, help_text="owner/pool name")
    region = models.CharField(max_length=64, blank=True)
    spot = models.BooleanField(default=False)
    start = models.DateTimeField()
    end = models.DateTimeField()
    seconds = models.PositiveIntegerField()
    gpus = models.DecimalField(max_digits=10, decimal_places=3,
                               help_text="GPU equivalents held (slots / 10); for idle, the average left free")
    gpu_seconds = models.DecimalField(max_digits=18, decimal_places=1, help_text="GPU-seconds, exact")
    rate_usd_per_gpu_hour = models.DecimalField(max_digits=14, decimal_places=6)
    # The job's requested CPU and memory on the node for the line's seconds, when its pool charges them.
    cpu_core_seconds = models.DecimalField(max_digits=18, decimal_places=3, default=0, help_text="vCPU-seconds")
    memory_gib_seconds = models.DecimalField(max_digits=24, decimal_places=10, default=0,
                                             help_text="GiB-seconds (memory_mb / 1024), exact")
    cpu_rate_usd_per_core_hour = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    memory_rate_usd_per_gib_hour = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    cpu_amount_usd = models.DecimalField(max_digits=14, decimal_places=2, default=0)
    memory_amount_usd = models.DecimalField(max_digits=14, decimal_places=2, default=0)
    # The line's total: GPU amount + cpu_amount_usd + memory_amount_usd, each rounded once to the cent.
    amount_usd = models.DecimalField(max_digits=14, decimal_places=2)
    avg_gpu_utilisation = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "day"], name="billing_usage_tenant_day"),
                   models.Index(fields=["tenant", "month"], name="billing_usage_tenant_month")]
        ordering = ["day", "id"]

    @property
    def gpu_hours(self) -> Decimal:
        return self.gpu_seconds / Decimal(3600)

    @property
    def gpu_amount_usd(self) -> Decimal:
        return self.amount_usd - self.cpu_amount_usd - self.memory_amount_usd

    def save(self, *args, **kwargs) -> None:
        if self.pk is not None and not kwargs.get("force_insert"):
            raise AppendOnly("Usage records are append-only.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AppendOnly("Usage records are append-only.")


class BillingMonth(models.Model):
    """One team's month: the row metering and the month close lock, so a record is never written into a
    statement already frozen. `closed_at` set = the statement below is final."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="billing_months")
    month = models.CharField(max_length=7)
    closed_at = models.DateTimeField(null=True, blank=True)
    # The frozen statement (broker.billing.statements.statement_build's output) once closed.
    statement = models.JSONField(default=dict, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "month"], name="uniq_billing_month")]
        ordering = ["tenant_id", "month"]

    def save(self, *args, **kwargs) -> None:
        if self.pk is not None and not kwargs.get("force_insert"):
            frozen = BillingMonth.objects.filter(pk=self.pk, closed_at__isnull=False).exists()
            if frozen:
                raise AppendOnly(f"The statement of {self.month} is closed.")
        super().save(*args, **kwargs)


class UserBudget(models.Model):
    """A team member's own monthly budget, set by a team admin: the month-to-date cost of the jobs they own
    (idle lines are the team's) is checked against it as the team's spend is against Quota.monthly_budget_usd."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="user_budgets")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="budgets")
    monthly_budget_usd = models.DecimalField(max_digits=14, decimal_places=2)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "user"], name="uniq_user_budget")]
        ordering = ["tenant_id", "user_id"]


class BudgetAlert(models.Model):
    """The event of a team's month-to-date spend reaching a share of its monthly budget (80, 100), or, with
    `user` set, of one member's spend reaching a share of their own budget."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="budget_alerts")
    # null = the team's alert. Two partial constraints: NULLs are distinct in a plain unique constraint.
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, null=True, blank=True,
                             related_name="budget_alerts")
    month = models.CharField(max_length=7)
    threshold_pct = models.PositiveSmallIntegerField()
    spent_usd = models.DecimalField(max_digits=14, decimal_places=2)
    budget_usd = models.DecimalField(max_digits=14, decimal_places=2)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "month", "threshold_pct"],
                                               condition=models.Q(user__isnull=True), name="uniq_budget_alert"),
                       models.UniqueConstraint(fields=["tenant", "user", "month", "threshold_pct"],
                                               condition=models.Q(user__isnull=False),
                                               name="uniq_user_budget_alert")]
        ordering = ["-created_at"]


class OnDemandPrice(models.Model):
    """The cheapest on-demand cloud price per GPU-hour of a GPU model a team could rent through, as it
    stood on a UTC day: what the savings report prices that day's GPU time at (broker/billing/savings.py).
    Written once per team and day by the metering task; never changed."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="on_demand_prices")
    day = models.DateField()
    gpu_model = models.CharField(max_length=64)
    usd_per_gpu_hour = models.DecimalField(max_digits=14, decimal_places=6)
    offer = models.CharField(max_length=200, help_text="provider region instance type")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "day", "gpu_model"], name="uniq_on_demand_price")]
