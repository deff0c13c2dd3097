"""/team/: members and roles, API tokens, quotas and the monthly budget.

Writes go through the services the API calls (broker.tenancy.services api_token_create /
api_token_revoke / membership_role_set, broker.billing.services.budget_set) and input through the API's
serializers (TokenCreateSerializer, BudgetInSerializer), so a bad value is refused in the API's words.
Tokens follow the API's rule (broker/api/tokens.py): a member sees and revokes only their own, an admin
all of the team's; another member's token is not found for a member, another team's for anyone.
Quotas are the platform's to set: shown, not edited. Roles and the budget: team admins only.
"""
from __future__ import annotations

from datetime import timedelta
import re

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from broker.api.tokens import TokenCreateSerializer, TokenSerializer
from broker.billing.api import BudgetInSerializer
from broker.billing.selectors import month_to_date_spend
from broker.billing.services import budget_set
from broker.billing.statements import budget_status
from broker.console.access import console_page, refuse, team_object_or_404
from broker.jobs.selectors import tenant_gpu_usage
from broker.tenancy import services
from broker.tenancy.models import ApiToken, Membership, Quota, Role, TokenScope
from broker.tenancy.selectors import team_quota_usage

ASCII_INT = re.compile(r"-?[0-9]{1,9}")


def _tokens(request: HttpRequest):
    """The tokens the caller may see and revoke: as TokenViewSet.scope (admin: the team's; else own)."""
    queryset = ApiToken.objects.select_related("user").filter(tenant=request.console.tenant).order_by("-created_at")
    return queryset if request.console.is_admin else queryset.filter(user=request.user)


def _errors(detail) -> dict[str, list[str]]:
    return {field: [str(m) for m in (msgs if isinstance(msgs, list) else [msgs])] for field, msgs in detail.items()}


def _page(request: HttpRequest, *, status: int = 200, **extra) -> HttpResponse:
    tenant = request.console.tenant
    quota, _ = Quota.objects.get_or_create(tenant=tenant)
    members = list(Membership.objects.select_related("user").filter(tenant=tenant).order_by("user__username"))
    context = {
        "nav": "team", "members": members, "roles": Role.choices, "scopes": TokenScope.values,
        "tokens": TokenSerializer(_tokens(request), many=True).data,
        "quota": quota, "usage": tenant_gpu_usage(tenant=tenant), "shared": team_quota_usage(tenant=tenant),
        "budget": budget_status(tenant=tenant, spent=month_to_date_spend(tenant=tenant, now=timezone.now())),
        "token_form": {"name": "", "scopes": [TokenScope.READ, TokenScope.WRITE], "expires_in_days": "90"},
        "token_errors": {}, "budget_errors": {}, "role_errors": {},
        "budget_value": "" if quota.monthly_budget_usd is None else str(quota.monthly_budget_usd),
        **extra,
    }
    return render(request, "console/team.html", context, status=status)


@console_page
def team(request: HttpRequest) -> HttpResponse:
    return _page(request)


@console_page
@require_POST
def token_create(request: HttpRequest) -> HttpResponse:
    """Any writer creates their own token; the secret is shown on the answer page and never again."""
    days = request.POST.get("expires_in_days", "").strip()
    data: dict = {"name": request.POST.get("name", ""), "scopes": request.POST.getlist("scopes")}
    if days:
        # The API takes a JSON number; a form sends text: ASCII digits become the number, anything else
        # goes through as it is so the serializer refuses it in its own words.
        data["expires_in_days"] = int(days) if ASCII_INT.fullmatch(days) else days
    body = TokenCreateSerializer(data=data)
    if not body.is_valid():
        form = {"name": data["name"], "scopes": data["scopes"], "expires_in_days": days}
        return _page(request, status=400, token_form=form, token_errors=_errors(body.errors))
    days = body.validated_data.get("expires_in_days")
    created = services.api_token_create(
        tenant=request.console.tenant, user=request.user, name=body.validated_data["name"],
        scopes=body.validated_data.get("scopes") or [TokenScope.READ, TokenScope.WRITE],
        expires_at=timezone.now() + timedelta(days=days) if days else None)
    return render(request, "console/team_token_created.html",
                  {"nav": "team", "token": TokenSerializer(created.token).data, "secret": created.secret}, status=201)


@console_page
@require_POST
def token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    token = team_object_or_404(_tokens(request), request, pk=token_id)
    if not request.console.may_change(owner_id=token.user_id):  # _tokens already narrows; the rule, said once more
        return refuse(request, "Members revoke only their own tokens.")
    services.api_token_revoke(token=token)
    messages.success(request, f"Token {token.prefix}… ({token.name}) is revoked.")
    return redirect("console:team")


@console_page(admin=True)
@require_POST
def member_role(request: HttpRequest, membership_id: int) -> HttpResponse:
    membership = team_object_or_404(Membership.objects.select_related("user"), request, pk=membership_id)
    try:
        services.membership_role_set(membership=membership, role=request.POST.get("role", ""))
    except services.MembershipError as exc:
        return _page(request, status=400, role_errors={membership.pk: str(exc)})
    messages.success(request, f"{membership.user.get_username()} is now {membership.get_role_display().lower()}.")
    return redirect("console:team")


@console_page(admin=True)
@require_POST
def budget(request: HttpRequest) -> HttpResponse:
    raw = request.POST.get("monthly_budget_usd", "").strip()
    body = BudgetInSerializer(data={"monthly_budget_usd": raw or None})  # empty: no budget (the API's null)
    if not body.is_valid():
        return _page(request, status=400, budget_errors=_errors(body.errors), budget_value=raw)
    budget_set(tenant=request.console.tenant, monthly_budget_usd=body.validated_data["monthly_budget_usd"])
    messages.success(request, "The monthly budget is saved.")
    return redirect("console:team")
