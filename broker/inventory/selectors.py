"""Reads for pools and nodes: who may use which pool, and which teams one scheduling cycle covers.

The one rule (issue 11): a team may use a pool it owns or one it was granted (`PoolGrant`). Every
path that places work or shows capacity asks it here: the API's pool and node lists, the scheduler's
snapshot (`NodeState.tenants`, `CloudOffer.tenants`), the commit of an allocation, a move's targets.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from django.db.models import Q, QuerySet

from broker.inventory.models import Node, Pool, PoolGrant
from broker.tenancy.models import Tenant


def pool_access_q(tenant_id: int, *, pool_field: str = "") -> Q:
    """Q over Pool (or, with `pool_field="pool"`, over rows with a pool foreign key) for the pools
    `tenant_id` may use. A subquery rather than a join on grants, so a pool granted to many teams is
    still one row."""
    granted = PoolGrant.objects.filter(tenant_id=tenant_id).values("pool_id")
    if not pool_field:
        return Q(tenant_id=tenant_id) | Q(pk__in=granted)
    return Q(**{f"{pool_field}__tenant_id": tenant_id}) | Q(**{f"{pool_field}_id__in": granted})


def pools_usable_by(tenant: Tenant) -> QuerySet[Pool]:
    return Pool.objects.filter(pool_access_q(tenant.pk))


def nodes_usable_by(tenant: Tenant) -> QuerySet[Node]:
    return Node.objects.filter(pool_access_q(tenant.pk, pool_field="pool"))


def usable_pool_ids(*, tenant_id: int, pool_ids: Iterable[int]) -> set[int]:
    """Which of `pool_ids` the team may use (one query)."""
    wanted = set(pool_ids)
    return set(Pool.objects.filter(pool_access_q(tenant_id), pk__in=wanted).values_list("pk", flat=True))


def pool_team_ids(pool_ids: Iterable[int]) -> dict[int, frozenset[int]]:
    """Ids of the teams that may use each pool: its owner and its grantees."""
    ids = set(pool_ids)
    teams: dict[int, set[int]] = defaultdict(set)
    for pool_id, owner_id in Pool.objects.filter(pk__in=ids).values_list("pk", "tenant_id"):
        teams[pool_id].add(owner_id)
    for pool_id, tenant_id in PoolGrant.objects.filter(pool_id__in=ids).values_list("pool_id", "tenant_id"):
        teams[pool_id].add(tenant_id)
    return {pool_id: frozenset(members) for pool_id, members in teams.items()}


def pool_teams(pool_ids: Iterable[int]) -> dict[int, tuple[str, ...]]:
    """Slugs of the teams that may use each pool: its owner and its grantees, sorted (the engine's
    `NodeState.tenants` / `CloudOffer.tenants`)."""
    ids = set(pool_ids)
    teams: dict[int, set[str]] = defaultdict(set)
    for pool_id, slug in Pool.objects.filter(pk__in=ids).values_list("pk", "tenant__slug"):
        teams[pool_id].add(slug)
    for pool_id, slug in PoolGrant.objects.filter(pool_id__in=ids).values_list("pool_id", "tenant__slug"):
        teams[pool_id].add(slug)
    return {pool_id: tuple(sorted(slugs)) for pool_id, slugs in teams.items()}


def pools_shared(pool_ids: Iterable[int]) -> set[int]:
    """Which of the pools are shared: granted to at least one team besides the owner."""
    return set(PoolGrant.objects.filter(pool_id__in=set(pool_ids)).values_list("pool_id", flat=True))


def scheduling_components(tenant_ids: Iterable[int] | None = None) -> list[list[int]]:
    """Teams connected through shared pools, as sorted lists of tenant ids, sorted by lowest id.

    A grant joins the pool's owner and the grantee; teams that can reach the same capacity (directly
    or through a chain of grants) are decided in one cycle, since one team's placement changes what
    the others can get. A team that shares nothing is a component of its own. `tenant_ids` limits the
    result to the components containing those teams (None: every tenant)."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    for owner_id, grantee_id in PoolGrant.objects.values_list("pool__tenant_id", "tenant_id"):
        union(owner_id, grantee_id)
    wanted = set(Tenant.objects.values_list("pk", flat=True)) if tenant_ids is None else set(tenant_ids)
    groups: dict[int, set[int]] = defaultdict(set)
    for tenant_id in wanted:
        groups[find(tenant_id)].add(tenant_id)
    # The rest of each wanted component (teams reached only through grants).
    for member in list(parent):
        root = find(member)
        if root in groups:
            groups[root].add(member)
    return sorted((sorted(members) for members in groups.values()), key=lambda members: members[0])


def scheduling_component(tenant: Tenant) -> list[Tenant]:
    """The teams one cycle for `tenant` decides for (itself alone when it shares nothing), by id."""
    (members,) = scheduling_components([tenant.pk])
    if members == [tenant.pk]:
        return [tenant]
    return list(Tenant.objects.filter(pk__in=members).order_by("pk"))
