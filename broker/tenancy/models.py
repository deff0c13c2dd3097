"""Tenants, who belongs to them, their API tokens and their quotas."""
from __future__ import annotations

from decimal import Decimal

from django.conf import settings
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
