"""Tenants, who belongs to them, their API tokens and their quotas."""
from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone


class Tenant(models.Model):
    """A team: the unit of isolation, quota and billing."""

    slug = models.SlugField(max_length=63, unique=True)
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    ADMIN = "admin", "Admin"
    MEMBER = "member", "Member"
    VIEWER = "viewer", "Viewer"


class Membership(models.Model):
    """A user's role in one tenant. A user may belong to several tenants."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "user"], name="uniq_membership")]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"

    @property
    def can_write(self) -> bool:
        return self.role in (Role.ADMIN, Role.MEMBER)


class TokenScope(models.TextChoices):
    READ = "read", "Read"
    WRITE = "write", "Write"


class ApiToken(models.Model):
    """A bearer token. Only a SHA-256 of the secret is stored; the prefix identifies it in lists."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_tokens")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    scopes = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "created_at"])]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    @property
    def is_active(self) -> bool:
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > timezone.now()


class Quota(models.Model):
    """Per-tenant limits. Zero GPUs / compute units means "no limit"; budget null means unlimited."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")
    max_gpus = models.PositiveIntegerField(default=0, help_text="0 = unlimited")
    max_compute_units = models.DecimalField(
        max_digits=12, decimal_places=3, default=Decimal("0"), validators=[MinValueValidator(0)],
        help_text="0 = unlimited",
    )
    monthly_budget_usd = models.DecimalField(
        max_digits=14, decimal_places=2, null=True, blank=True, validators=[MinValueValidator(0)]
    )
    max_pending_jobs = models.PositiveIntegerField(default=10000)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"quota({self.tenant})"


# The flavor of a quota counted in compute units over every GPU model (scheduling.model.CU_FLAVOR).
CU_FLAVOR = "CU"


class TeamQuota(models.Model):
    """A team's share of the platform's owned GPUs of one flavor, as a Kueue ClusterQueue's quota of one
    resource flavor in a cohort (docs/quotas.md has the arithmetic, scheduling/quota.py enforces it).

    `flavor` is a GPU model's canonical name, or "CU" for compute units over all models. `nominal` is
    guaranteed: the team gets it back (borrowers are checkpointed and stopped) when it needs it.
    `borrowing_limit` caps what it may use above nominal (null: no cap); `lending_limit` caps how much
    of its unused nominal others may borrow (null: all of it). Rented capacity is not counted here:
    the team's budget limits what it rents."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="team_quotas")
    flavor = models.CharField(max_length=64, help_text='A GPU model name (e.g. A100-80GB) or "CU"')
    nominal = models.DecimalField(max_digits=12, decimal_places=3, validators=[MinValueValidator(0)],
                                  help_text="Guaranteed GPUs (or compute units) of owned capacity")
    borrowing_limit = models.DecimalField(
        max_digits=12, decimal_places=3, null=True, blank=True, validators=[MinValueValidator(0)],
        help_text="Most it may use above nominal; empty = no limit")
    lending_limit = models.DecimalField(
        max_digits=12, decimal_places=3, null=True, blank=True, validators=[MinValueValidator(0)],
        help_text="Most of its unused nominal other teams may borrow; empty = all of it")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "flavor"], name="uniq_team_quota_flavor"),
            # The database holds the same rules as clean(): a row written by any path stays meaningful.
            models.CheckConstraint(condition=models.Q(nominal__gte=0), name="team_quota_nominal_gte_0"),
            models.CheckConstraint(condition=models.Q(borrowing_limit__isnull=True) | models.Q(borrowing_limit__gte=0),
                                   name="team_quota_borrowing_gte_0"),
            models.CheckConstraint(
                condition=models.Q(lending_limit__isnull=True)
                | (models.Q(lending_limit__gte=0) & models.Q(lending_limit__lte=models.F("nominal"))),
                name="team_quota_lending_within_nominal"),
        ]
        ordering = ["tenant_id", "flavor"]

    def __str__(self) -> str:
        return f"{self.tenant} {self.flavor}: {self.nominal}"

    def clean(self) -> None:
        from broker.inventory.models import GpuModel  # inventory imports tenancy: not at module level

        errors: dict[str, str] = {}
        if self.flavor != CU_FLAVOR and not GpuModel.objects.filter(name=self.flavor).exists():
            errors["flavor"] = (f"Unknown flavor {self.flavor[:64]!r}: use \"{CU_FLAVOR}\" or a GPU model name "
                                f"({', '.join(GpuModel.objects.values_list('name', flat=True)) or 'none defined'}).")
        if self.nominal is not None and self.nominal < 0:
            errors["nominal"] = "The nominal quota cannot be negative."
        if self.borrowing_limit is not None and self.borrowing_limit < 0:
            errors["borrowing_limit"] = "The borrowing limit cannot be negative (leave it empty for no limit)."
        if self.lending_limit is not None and self.nominal is not None:
            if self.lending_limit < 0:
                errors["lending_limit"] = "The lending limit cannot be negative."
            elif self.lending_limit > self.nominal:
                errors["lending_limit"] = (f"The lending limit ({self.lending_limit:g}) cannot exceed the nominal "
                                           f"quota ({self.nominal:g}): a team only lends what it is guaranteed.")
        if errors:
            raise ValidationError(errors)


class FairShareUsage(models.Model):
    """A team's past use of one flavor of owned capacity, in GPU-hours (CU-hours for "CU") decayed with
    the fair-share half-life (WHALEZEN_FAIR_SHARE_HALF_LIFE_HOURS): the U of Slurm's 2^(-U/S). Updated
    once per scheduling cycle by broker.tenancy.services.fair_share_usage_update."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="fair_share_usage")
    flavor = models.CharField(max_length=64)
    decayed_hours = models.FloatField(default=0.0)
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "flavor"], name="uniq_fair_share_usage")]
        ordering = ["tenant_id", "flavor"]

    def __str__(self) -> str:
        return f"{self.tenant} {self.flavor}: {self.decayed_hours:.2f} h"
