"""Writes for tenants, memberships and API tokens."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Iterable, Sequence

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F, FilteredRelation, Q, QuerySet
from django.utils import timezone

from broker.rows import CompiledRead
from broker.tenancy import tokens
from broker.tenancy.selectors import owned_holdings
from broker.tenancy.models import (CU_FLAVOR, ApiToken, FairShareUsage, Membership, Quota, Role, TeamQuota, Tenant,
                                   TokenScope)


@dataclass(frozen=True)
class CreatedToken:
    token: ApiToken
    secret: str  # the only time the plaintext exists


def tenants_lock(tenant_ids: Iterable[int]) -> None:
    """Lock the teams' rows until the transaction ends, in id order (two lockers cannot deadlock): what
    serialises a team's quota checks and its uploads. FOR NO KEY UPDATE, not FOR UPDATE: a team's key never
    changes, and FOR UPDATE also blocks every row inserted that refers to the team (the foreign-key check
    of a submitted job takes FOR KEY SHARE on it), so each submission waited for a scheduling cycle's commit
    to end. Lockers still exclude each other. Nothing on SQLite, whose writers take the whole database."""
    list(Tenant.objects.select_for_update(no_key=True).filter(pk__in=sorted(set(tenant_ids))).order_by("pk")
         .values_list("pk", flat=True))


def tenant_create(*, slug: str, name: str) -> Tenant:
    with transaction.atomic():
        tenant = Tenant.objects.create(slug=slug, name=name)
        Quota.objects.create(tenant=tenant)
    return tenant


def membership_add(*, tenant: Tenant, user: AbstractBaseUser, role: str = Role.MEMBER) -> Membership:
    membership, _ = Membership.objects.update_or_create(tenant=tenant, user=user, defaults={"role": role})
    return membership


class MembershipError(Exception):
    """A refused membership change (the message is for the admin who asked)."""

    def __init__(self, message: str, *, field: str = "role") -> None:
        super().__init__(message)
        self.field = field


def membership_role_set(*, membership: Membership, role: str) -> Membership:
    """Change one member's role. Refuses an unknown role, and demoting the team's last admin (a team
    nobody can administer any more could only be mended by a platform operator). The admins are locked
    while counting, so two admins demoting each other at once cannot leave the team with none."""
    if role not in Role.values:
        raise MembershipError(f"{str(role)[:20]!r} is not a role: use one of {', '.join(Role.values)}.")
    with transaction.atomic():
        locked = Membership.objects.select_for_update().get(pk=membership.pk)
        if locked.role == Role.ADMIN and role != Role.ADMIN:
            admins = list(Membership.objects.select_for_update()
                          .filter(tenant_id=locked.tenant_id, role=Role.ADMIN).values_list("pk", flat=True))
            if admins == [locked.pk]:
                raise MembershipError("This is the team's last admin: make another member an admin first.")
        if locked.role != role:
            locked.role = role
            locked.save(update_fields=["role"])
    membership.role = locked.role
    return locked


def api_token_create(
    *,
    tenant: Tenant,
    user: AbstractBaseUser,
    name: str,
    scopes: list[str] | None = None,
    expires_at: datetime | None = None,
) -> CreatedToken:
    issued = tokens.issue("wz")
    token = ApiToken.objects.create(
        tenant=tenant,
        user=user,
        name=name,
        prefix=issued.prefix,
        secret_hash=issued.digest,
        scopes=sorted(set(scopes or [TokenScope.READ, TokenScope.WRITE])),
        expires_at=expires_at,
    )
    return CreatedToken(token=token, secret=issued.plaintext)


def api_token_revoke(*, token: ApiToken) -> ApiToken:
    """Idempotent: revoking twice keeps the first revocation time."""
    ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    token.refresh_from_db()
    return token


def api_token_authenticate(*, presented: str) -> ApiToken | None:
    """The active token matching `presented`, or None. Records last use at most once a minute."""
    found = api_token_membership_authenticate(presented=presented)
    return found[0] if found is not None else None


def api_token_membership_authenticate(*, presented: str) -> tuple[ApiToken, Membership | None] | None:
    """`api_token_authenticate`, with the token's user's membership of the token's tenant (None when
    the user has left it), read in the same query: this runs on every API request, and the second
    query (and its compilation) was half of authentication's CPU (py-spy, bench.service submissions)."""
    prefix = tokens.split_prefix(presented)
    if prefix is None:
        return None
    found = _token_rows(prefix)
    if found is None:
        return None
    token, membership = found
    if not tokens.matches(presented, token.secret_hash) or not token.is_active:
        return None
    now = timezone.now()
    if token.last_used_at is None or (now - token.last_used_at).total_seconds() > 60:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token, membership


_MEMBERSHIP_COLUMNS = ("id", "role", "created_at")


@functools.cache
def _token_lookup_fields() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The token's, its tenant's and its user's columns, in the lookup's order (read back by `_token_rows`)."""
    from django.contrib.auth import get_user_model

    token, tenant, user = (tuple(f.attname for f in model._meta.concrete_fields)
                           for model in (ApiToken, Tenant, get_user_model()))
    return token, tenant, user


def _token_lookup_queryset(prefix: str) -> QuerySet:
    """The token of `prefix` (unique: no ORDER BY), its tenant and user, and the user's membership of
    the token's own tenant (uniq_membership: at most one row), as one row of plain columns."""
    token_fields, tenant_fields, user_fields = _token_lookup_fields()
    columns = ([*token_fields] + [f"tenant__{name}" for name in tenant_fields]
               + [f"user__{name}" for name in user_fields]
               + [f"token_membership__{name}" for name in _MEMBERSHIP_COLUMNS])
    return (ApiToken.objects
            .annotate(token_membership=FilteredRelation(
                "user__memberships", condition=Q(user__memberships__tenant=F("tenant"))))
            .filter(prefix=prefix).values_list(*columns)[:1])


# Compiled once per database (broker/rows.py): compiling the query's three joins was most of
# authentication's CPU, on every request.
_TOKEN_LOOKUP = CompiledRead(_token_lookup_queryset)


def _token_rows(prefix: str) -> tuple[ApiToken, Membership | None] | None:
    from django.contrib.auth import get_user_model
    from django.db import router

    alias = router.db_for_read(ApiToken)
    found = _TOKEN_LOOKUP.rows(prefix, using=alias)
    if not found:
        return None
    values = found[0]
    User = get_user_model()
    token_fields, tenant_fields, user_fields = _token_lookup_fields()
    at = len(token_fields)
    token = ApiToken.from_db(alias, token_fields, values[:at])
    tenant = Tenant.from_db(alias, tenant_fields, values[at:at + len(tenant_fields)])
    at += len(tenant_fields)
    user = User.from_db(alias, user_fields, values[at:at + len(user_fields)])
    at += len(user_fields)
    token.tenant, token.user = tenant, user
    membership_pk, role, created_at = values[at:]
    if membership_pk is None:
        return token, None
    membership = Membership.from_db(alias, ["id", "tenant_id", "user_id", "role", "created_at"],
                                    [membership_pk, token.tenant_id, token.user_id, role, created_at])
    membership.tenant, membership.user = tenant, user
    return token, membership


# ------------------------------------------------------------------------------------ team quotas


class QuotaError(Exception):
    """A refused quota change; `field` names the bad input (for a 400 body or a CommandError)."""

    def __init__(self, message: str, *, field: str = "non_field_errors") -> None:
        super().__init__(message)
        self.field = field


def _decimal(value: Decimal | float | int | str | None, *, field: str) -> Decimal | None:
    if value is None:
        return None
    try:
        number = Decimal(str(value))
    except (InvalidOperation, ValueError):
        raise QuotaError(f"{field} must be a number, not {str(value)[:20]!r}.", field=field) from None
    if not number.is_finite():
        raise QuotaError(f"{field} must be a finite number.", field=field)
    return number


def quota_flavor_resolve(flavor: str) -> str:
    """The canonical flavor for what an admin wrote: "CU" (any case), or a GPU model's name (or alias)."""
    from broker.inventory.services import gpu_model_resolve  # inventory imports tenancy: not at module level

    if flavor.strip().upper() == CU_FLAVOR:
        return CU_FLAVOR
    model = gpu_model_resolve(flavor)
    if model is None:
        from broker.inventory.models import GpuModel

        known = ", ".join(GpuModel.objects.values_list("name", flat=True)) or "none defined"
        raise QuotaError(f'Unknown flavor {flavor[:64]!r}: use "{CU_FLAVOR}" or a GPU model ({known}).',
                         field="flavor")
    return model.name


def team_quota_set(*, tenant: Tenant, flavor: str, nominal: Decimal | float | int | str,
                   borrowing_limit: Decimal | float | int | str | None = None,
                   lending_limit: Decimal | float | int | str | None = None) -> TeamQuota:
    """Create or replace the team's quota of one flavor (a limit left out means "none": no borrowing
    cap, all of nominal lendable). Validated as a whole before anything is written."""
    canonical = quota_flavor_resolve(flavor)
    quota = TeamQuota.objects.filter(tenant=tenant, flavor=canonical).first() or TeamQuota(tenant=tenant,
                                                                                           flavor=canonical)
    quota.nominal = _decimal(nominal, field="nominal")
    quota.borrowing_limit = _decimal(borrowing_limit, field="borrowing_limit")
    quota.lending_limit = _decimal(lending_limit, field="lending_limit")
    try:
        quota.full_clean(exclude=["tenant"], validate_unique=False, validate_constraints=False)
    except ValidationError as exc:
        field, messages = next(iter(exc.message_dict.items()))
        raise QuotaError(" ".join(messages), field=field) from None
    with transaction.atomic():
        quota.save()
    return quota


def team_quota_delete(*, tenant: Tenant, flavor: str) -> bool:
    """Remove the team's quota of a flavor; False when it had none."""
    deleted, _ = TeamQuota.objects.filter(tenant=tenant, flavor=quota_flavor_resolve(flavor)).delete()
    return bool(deleted)


# ------------------------------------------------------------------------------------- fair share


def fair_share_half_life_hours() -> float:
    return float(getattr(settings, "WHALEZEN_FAIR_SHARE_HALF_LIFE_HOURS", 168.0))


def decayed_usage(*, previous: float, held: float, seconds: float, half_life_hours: float) -> float:
    """U after `seconds` more: the old usage halves every half-life, plus what was held meanwhile.

    U <- U * 2^(-dt/H) + held * dt / 3600, with dt and H in seconds and `held` in GPUs (or CU): the
    holdings at update time stand for the whole interval (one cycle), Slurm's decay in discrete steps."""
    seconds = max(0.0, seconds)
    decay = 2.0 ** (-seconds / (half_life_hours * 3600.0)) if half_life_hours > 0 else 0.0
    return previous * decay + held * seconds / 3600.0


def fair_share_step_seconds() -> float:
    return float(getattr(settings, "WHALEZEN_FAIR_SHARE_STEP_SECONDS", 30.0))


def fair_share_usage_due(*, tenants: Sequence[Tenant], now: datetime | None = None) -> bool:
    """Whether these teams' usage is older than one step (`WHALEZEN_FAIR_SHARE_STEP_SECONDS`) and a cycle
    should bring it up to date. Reading what every running job holds on owned nodes was most of a cycle
    with nothing new to decide (0.26 of 0.35 s with 5,000 jobs running, bench.service); at a half-life of
    days, a step of seconds changes no factor that orders anyone. One indexed query."""
    now = now or timezone.now()
    recent = now - timedelta(seconds=fair_share_step_seconds())
    return not FairShareUsage.objects.filter(tenant__in=list(tenants), updated_at__gt=recent).exists()


def fair_share_usage_update(*, tenants: Sequence[Tenant], now: datetime | None = None,
                            half_life_hours: float | None = None) -> dict[tuple[str, str], float]:
    """Decay every (team, flavor) usage of these teams to `now` and add what they hold on owned nodes
    (`decayed_usage`). A flavor seen for the first time starts at 0 from now: there is no interval to
    charge yet. Called once per scheduling cycle under the component's lease (one writer); the rows
    are locked anyway, so a stray second caller waits and adds only its own (short) interval."""
    now = now or timezone.now()
    half_life = fair_share_half_life_hours() if half_life_hours is None else half_life_hours
    ids = [t.pk for t in tenants]
    slug = {t.pk: t.slug for t in tenants}
    result: dict[tuple[str, str], float] = {}
    with transaction.atomic():
        existing = {(row.tenant_id, row.flavor): row
                    for row in FairShareUsage.objects.select_for_update().filter(tenant_id__in=ids)}
        held = owned_holdings(tenant_ids=ids)
        for key in sorted(set(existing) | set(held)):
            row = existing.get(key)
            if row is None:
                row = FairShareUsage.objects.create(tenant_id=key[0], flavor=key[1], decayed_hours=0.0, updated_at=now)
            else:
                seconds = (now - row.updated_at).total_seconds()
                if seconds > 0:  # a clock step back charges nothing rather than a negative interval
                    row.decayed_hours = decayed_usage(previous=row.decayed_hours, held=held.get(key, 0.0),
                                                      seconds=seconds, half_life_hours=half_life)
                    row.updated_at = now
                    row.save(update_fields=["decayed_hours", "updated_at"])
            result[slug[key[0]], key[1]] = row.decayed_hours
    return result


def fair_share_usage_sweep(*, now: datetime | None = None) -> int:
    """Bring every team's usage up to date, whether or not a cycle runs for it: cycles run only while
    something is pending, and a team whose jobs ran for days with nothing pending would otherwise be
    charged (or not) for those days all at once with whatever it holds at the next cycle. Periodic
    (the scheduler's sweep), for the teams whose usage is older than a step (`fair_share_usage_due`);
    returns how many teams were updated."""
    from broker.inventory.models import OWNED_POOL_KINDS
    from broker.jobs.models import AllocationSlice

    now = now or timezone.now()
    recent = now - timedelta(seconds=fair_share_step_seconds())
    if FairShareUsage.objects.exists() and not FairShareUsage.objects.filter(updated_at__lte=recent).exists():
        return 0  # every usage is younger than a step (a cycle or the last sweep): nothing is due yet
    holding = AllocationSlice.objects.filter(active=True, gpu__node__pool__kind__in=OWNED_POOL_KINDS).values(
        "allocation__job__tenant_id")
    with_rows = FairShareUsage.objects.values("tenant_id")
    fresh = FairShareUsage.objects.filter(updated_at__gt=recent).values("tenant_id")
    tenants = list(Tenant.objects.filter(Q(pk__in=holding) | Q(pk__in=with_rows)).exclude(pk__in=fresh)
                   .order_by("pk"))
    if tenants:
        fair_share_usage_update(tenants=tenants, now=now)
    return len(tenants)
