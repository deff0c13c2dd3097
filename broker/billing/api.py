"""/api/v1/costs/, /statements/, /statements/{YYYY-MM}/, /budget/, /quotes/: the team's money.

Everything reads the caller's tenant only (there is no tenant in any URL: another team's figures are
simply absent), except for platform admins, who may name a team or all of them with `?team=`
(broker/billing/scope.py). Team admins see the whole team; members and viewers see the costs of their
own jobs (no idle lines, which are the team's) and no statements. Bad parameters answer 400 with the field and
the reason, `?format=csv` or `Accept: text/csv` gives CSV, a statement also renders as printable HTML
(`?format=html`).
"""
from __future__ import annotations

import csv
import io
import os
from datetime import date, timedelta

from django.db import transaction
from django.db.models import Q
from django.http import Http404
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import exceptions, serializers
from rest_framework.permissions import BasePermission
from rest_framework.renderers import BaseRenderer, JSONRenderer, TemplateHTMLRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from broker.api.fields import StrictSerializer
from broker.api.schema import FIELD_ERRORS, THROTTLED, WhaleZenAutoSchema
from broker.api.throttles import JobSubmitThrottle
from broker.billing.metering import month_of
from broker.billing.models import BudgetAlert
from broker.billing.selectors import GROUP_FIELDS, cost_report, month_to_date_spend
from broker.billing.services import BillingError, budget_set, user_budgets_set
from broker.billing.scope import ALL_TEAMS, billing_teams, reads_whole_team
from broker.billing.statements import budget_status, statement_get, statements_list, user_budget_lines
from broker.tenancy.models import Tenant
from broker.tenancy.permissions import IsTenantAdmin, IsTenantMember, tenant_context

MAX_RANGE_DAYS = 400


class CSVRenderer(BaseRenderer):
    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None) -> bytes:
        rows = None
        if isinstance(data, dict):
            rows = data.get("rows", data.get("lines", data.get("results")))
        elif isinstance(data, list):
            rows = data
        out = io.StringIO()
        writer = csv.writer(out)
        if rows is None:  # an error body: one row per field and reason
            writer.writerow(["field", "reason"])
            for key, value in (data or {}).items():
                for reason in (value if isinstance(value, list) else [value]):
                    writer.writerow([key, reason])
            return out.getvalue().encode()
        columns: list[str] = []
        for row in rows:
            columns += [c for c in row if c not in columns]
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if row.get(c) is None else row.get(c) for c in columns])
        return out.getvalue().encode()


class StatementHTMLRenderer(TemplateHTMLRenderer):
    template_name = "billing/statement.html"
    format = "html"


class IsTenantReader(BasePermission):
    """Any member of the tenant, whatever the method (a quote is a POST that changes nothing)."""

    message = "You do not belong to a tenant."

    def has_permission(self, request: Request, view) -> bool:
        return tenant_context(request) is not None


class CostRowSerializer(serializers.Serializer):
    team = serializers.CharField(required=False)
    user = serializers.CharField(required=False, help_text='The job owner, or "__idle__"')
    job = serializers.JSONField(required=False, help_text='The job id, or "__idle__" for idle rented capacity')
    gpu_model = serializers.CharField(required=False)
    provider = serializers.CharField(required=False)
    pool = serializers.CharField(required=False, help_text="owner/pool")
    region = serializers.CharField(required=False)
    day = serializers.CharField(required=False, help_text="YYYY-MM-DD (UTC)")
    gpu_hours = serializers.FloatField(help_text="GPU-hours held by jobs")
    cost = serializers.CharField(help_text="Dollars, idle included, to the cent")
    idle_gpu_hours = serializers.FloatField()
    idle_cost = serializers.CharField(help_text="The idle part of cost")
    cpu_cost = serializers.CharField(help_text="The part of cost for the jobs' requested CPU (owned pools with a "
                                               "CPU rate; 0.00 elsewhere)")
    memory_cost = serializers.CharField(help_text="The part of cost for the jobs' requested memory (owned pools "
                                                  "with a memory rate; 0.00 elsewhere)")
    avg_gpu_utilisation = serializers.FloatField(allow_null=True, help_text="% while held; null without telemetry")


class CostReportSerializer(serializers.Serializer):
    scope = serializers.CharField(help_text='"team" (admins) or "user <name>" (their own jobs only)')
    currency = serializers.CharField()
    group_by = serializers.ListField(child=serializers.CharField())
    rows = CostRowSerializer(many=True)

    def get_fields(self):
        fields = super().get_fields()
        fields["from"] = serializers.CharField()
        fields["to"] = serializers.CharField(help_text="exclusive")
        return fields


class StatementLineSerializer(serializers.Serializer):
    kind = serializers.CharField(help_text='"usage" or "idle"')
    job = serializers.JSONField(help_text='The job id, or "__idle__"')
    job_name = serializers.CharField(allow_blank=True)
    user = serializers.CharField()
    allocation = serializers.IntegerField(allow_null=True)
    instance = serializers.IntegerField(allow_null=True)
    gpu_model = serializers.CharField(allow_blank=True)
    provider = serializers.CharField()
    pool = serializers.CharField()
    region = serializers.CharField(allow_blank=True)
    spot = serializers.BooleanField()
    start = serializers.CharField()
    end = serializers.CharField()
    seconds = serializers.IntegerField()
    gpu_hours = serializers.CharField()
    rate_usd_per_gpu_hour = serializers.CharField()
    cpu_core_hours = serializers.CharField(required=False, help_text="vCPU-hours requested, where charged")
    cpu_rate_usd_per_core_hour = serializers.CharField(required=False, allow_null=True,
                                                       help_text="null: CPU not charged")
    cpu_amount_usd = serializers.CharField(required=False, help_text="The CPU part of amount_usd")
    memory_gib_hours = serializers.CharField(required=False, help_text="GiB-hours requested, where charged")
    memory_rate_usd_per_gib_hour = serializers.CharField(required=False, allow_null=True,
                                                         help_text="null: memory not charged")
    memory_amount_usd = serializers.CharField(required=False, help_text="The memory part of amount_usd")
    amount_usd = serializers.CharField(help_text="The line's total: GPU + CPU + memory")


class StatementSerializer(serializers.Serializer):
    team = serializers.CharField()
    month = serializers.CharField()
    currency = serializers.CharField()
    status = serializers.CharField(help_text='"open" (live) or "closed" (frozen)')
    closed_at = serializers.CharField(allow_null=True)
    rounding = serializers.CharField()
    lines = StatementLineSerializer(many=True)
    totals = serializers.DictField()
    budget = serializers.DictField(required=False, help_text="The current month only")


class StatementSummarySerializer(serializers.Serializer):
    month = serializers.CharField()
    status = serializers.CharField()
    total_usd = serializers.CharField()


class StatementListSerializer(serializers.Serializer):
    results = StatementSummarySerializer(many=True)


class BudgetAlertSerializer(serializers.Serializer):
    threshold_pct = serializers.IntegerField()
    spent_usd = serializers.CharField()
    budget_usd = serializers.CharField()
    at = serializers.CharField()


class BudgetOutSerializer(serializers.Serializer):
    team = serializers.CharField()
    month = serializers.CharField()
    monthly_budget_usd = serializers.CharField(allow_null=True)
    spent_usd = serializers.CharField()
    remaining_usd = serializers.CharField(allow_null=True)
    used_pct = serializers.FloatField(allow_null=True)
    warning = serializers.BooleanField(help_text="80% of the budget reached")
    exceeded = serializers.BooleanField(help_text="100% reached: no new spending placement for the team")
    alerts = BudgetAlertSerializer(many=True)
    users = serializers.ListField(child=serializers.DictField(), help_text=(
        "Per-user budgets: {user, monthly_budget_usd, spent_usd, remaining_usd, used_pct, warning, exceeded, "
        "alerts}. Admins see every member's, others their own line only."))


class QuoteOutSerializer(serializers.Serializer):
    job = serializers.DictField()
    options = serializers.ListField(child=serializers.DictField(), help_text="Cheapest first")
    unplaceable = serializers.ListField(child=serializers.DictField(), help_text="Why not, when no option")
    quoted_at = serializers.CharField()


TEAM_PARAMETER = OpenApiParameter(
    "team", OpenApiTypes.STR, description="Platform admins only: a team's slug, or 'all' (costs: every team). "
    "Others may leave it out or name their own team.")
COST_PARAMETERS = [
    OpenApiParameter("from", OpenApiTypes.DATE, description="First day, YYYY-MM-DD (default: this month's 1st)"),
    OpenApiParameter("to", OpenApiTypes.DATE, description="Day after the last, exclusive (default: tomorrow)"),
    OpenApiParameter("group_by", OpenApiTypes.STR, description="Comma-separated: " + ", ".join(GROUP_FIELDS)),
    TEAM_PARAMETER,
]


class BillingView(APIView):
    renderer_classes = [JSONRenderer, CSVRenderer]
    schema = WhaleZenAutoSchema()

    def perform_content_negotiation(self, request, force=False):
        try:
            return super().perform_content_negotiation(request, force)
        except Http404:
            raise exceptions.ValidationError({"format": [
                f"Unknown format {str(request.query_params.get('format', ''))[:20]!r}: use "
                + " or ".join(r.format for r in self.renderer_classes) + "."]}) from None

    def handle_exception(self, exc):
        """Errors answer JSON whatever format was asked for (the API's one error shape)."""
        response = super().handle_exception(exc)
        self.request.accepted_renderer = JSONRenderer()
        self.request.accepted_media_type = JSONRenderer.media_type
        return response

    @property
    def ctx(self):
        return tenant_context(self.request)

    def user_filter(self) -> str | None:
        """None for an admin (the whole team), else the caller's own username."""
        return None if reads_whole_team(ctx=self.ctx, user=self.request.user) else self.request.user.get_username()

    def teams(self) -> list[Tenant]:
        """The caller's team, or what a platform admin names with `?team=` (broker/billing/scope.py)."""
        return billing_teams(team=self.request.query_params.get("team"), ctx=self.ctx, user=self.request.user)

    def one_team(self) -> Tenant:
        teams = self.teams()
        if len(teams) != 1 or self.request.query_params.get("team") == ALL_TEAMS:
            raise exceptions.ValidationError({"team": ["A statement is one team's: name it with team=<slug>."]})
        return teams[0]


class IsBillingAdmin(IsTenantMember):
    """A team admin of the caller's team, or a platform admin (statements, every job's costs)."""

    message = "Only a team admin (or a platform admin) may read statements."

    def has_permission(self, request: Request, view) -> bool:
        return super().has_permission(request, view) and reads_whole_team(ctx=tenant_context(request),
                                                                            user=request.user)


def _day(params, name: str, default: date) -> date:
    raw = params.get(name)
    if raw in (None, ""):
        return default
    try:
        return date.fromisoformat(str(raw)[:10]) if len(str(raw)) == 10 else _bad(name, raw)
    except ValueError:
        _bad(name, raw)


def _bad(name: str, raw) -> date:
    raise exceptions.ValidationError({name: [f"{str(raw)[:32]!r} is not a date: use YYYY-MM-DD."]})


def parse_cost_params(params) -> tuple[date, date, list[str]]:
    today = timezone.now().date()
    start = _day(params, "from", today.replace(day=1))
    end = _day(params, "to", today + timedelta(days=1))
    # The error names a parameter the caller gave (the other one took its default).
    blamed = "to" if params.get("to") not in (None, "") else "from"
    if end <= start:
        raise exceptions.ValidationError({blamed: [
            f"'to' ({end}) must be after 'from' ({start}); 'to' is exclusive (default: tomorrow)."]})
    if (end - start).days > MAX_RANGE_DAYS:
        raise exceptions.ValidationError({blamed: [f"At most {MAX_RANGE_DAYS} days per report."]})
    raw = str(params.get("group_by", "team"))
    group_by = [g.strip() for g in raw.split(",")]
    for g in group_by:
        if g not in GROUP_FIELDS:
            raise exceptions.ValidationError({"group_by": [
                f"Unknown key {g[:32]!r}: use one or more of {', '.join(GROUP_FIELDS)}, comma-separated."]})
    if len(set(group_by)) != len(group_by):
        raise exceptions.ValidationError({"group_by": ["A key is given twice."]})
    return start, end, group_by


class CostsView(BillingView):
    """GET ?from=YYYY-MM-DD&to=YYYY-MM-DD (exclusive)&group_by=team,user,job,gpu_model,provider,pool,region,day"""

    permission_classes = [IsTenantMember]

    @extend_schema(operation_id="costs_report", parameters=COST_PARAMETERS,
                   responses={200: CostReportSerializer, 400: FIELD_ERRORS})
    def get(self, request: Request) -> Response:
        start, end, group_by = parse_cost_params(request.query_params)
        teams, user = self.teams(), self.user_filter()
        rows = cost_report(tenants=teams, start=start, end=end, group_by=group_by, user=user)
        if request.query_params.get("team") == ALL_TEAMS:
            scope = "platform"
        elif teams != [self.ctx.tenant]:
            scope = f"team {teams[0].slug}"
        else:
            scope = "team" if user is None else f"user {user}"
        return Response({"from": start.isoformat(), "to": end.isoformat(), "group_by": group_by, "scope": scope,
                         "currency": "USD", "rows": rows})


class SavingsOutSerializer(serializers.Serializer):
    currency = serializers.CharField()
    jobs = serializers.ListField(child=serializers.DictField())
    totals = serializers.DictField()

    def get_fields(self):
        fields = super().get_fields()
        fields["from"] = serializers.CharField()
        fields["to"] = serializers.CharField()
        return fields


class SavingsView(BillingView):
    """GET ?from=&to=: per job, what it cost against the cheapest single-cloud on-demand offer of its GPU model."""

    permission_classes = [IsTenantMember]
    renderer_classes = [JSONRenderer]

    @extend_schema(operation_id="costs_savings", parameters=COST_PARAMETERS[:2],
                   responses={200: SavingsOutSerializer, 400: FIELD_ERRORS})
    def get(self, request: Request) -> Response:
        from broker.billing.savings import savings_report

        start, end, _ = parse_cost_params({k: v for k, v in request.query_params.items() if k != "group_by"})
        return Response(savings_report(tenant=self.ctx.tenant, start=start, end=end, user=self.user_filter()))


class StatementListView(BillingView):
    permission_classes = [IsBillingAdmin]

    @extend_schema(operation_id="statements_list", parameters=[TEAM_PARAMETER],
                   responses={200: StatementListSerializer, 400: FIELD_ERRORS})
    def get(self, request: Request) -> Response:
        return Response({"results": statements_list(tenant=self.one_team())})


class StatementDetailView(BillingView):
    permission_classes = [IsBillingAdmin]
    renderer_classes = [JSONRenderer, CSVRenderer, StatementHTMLRenderer]

    @extend_schema(operation_id="statements_month",
                   parameters=[OpenApiParameter("id", OpenApiTypes.STR, OpenApiParameter.PATH,
                                                description="The month, YYYY-MM (UTC)"), TEAM_PARAMETER],
                   responses={200: StatementSerializer, 400: FIELD_ERRORS})
    def get(self, request: Request, id: str) -> Response:  # noqa: A002 (the API's path parameter name)
        month = id
        if len(month) != 7 or not all(c in "0123456789-" for c in month):
            raise exceptions.ValidationError({"non_field_errors": [
                f"The path's month {month[:16]!r} is not a month: use YYYY-MM."]})
        try:
            statement = statement_get(tenant=self.one_team(), month=month)
        except BillingError as exc:
            raise exceptions.ValidationError({"non_field_errors": [f"The path's month: {exc}"]}) from None
        if not statement["lines"] and statement["status"] == "open" and month != month_of(timezone.now().date()):
            raise exceptions.NotFound(f"No statement for {month}.")
        return Response(statement)


MONEY_FIELD = {"max_digits": 14, "decimal_places": 2, "min_value": 0}
MAX_USER_BUDGETS = 200  # one PATCH; a team is rarely bigger, and the body stays small
MAX_USERNAME = 150  # Django's username length


class BudgetInSerializer(StrictSerializer):
    monthly_budget_usd = serializers.DecimalField(**MONEY_FIELD, allow_null=True, required=False,
                                                  help_text="The team's monthly budget; null = none")
    users = serializers.DictField(
        child=serializers.DecimalField(**MONEY_FIELD, allow_null=True), required=False, allow_empty=False,
        help_text="username -> that member's monthly budget in USD; null clears it")

    def validate_users(self, value: dict) -> dict:
        if len(value) > MAX_USER_BUDGETS:
            raise serializers.ValidationError(f"At most {MAX_USER_BUDGETS} users per request.")
        # Keys are not validated by DictField: a NUL would reach PostgreSQL (a 500), a long one the reply.
        bad = next((name for name in value if not name or len(name) > MAX_USERNAME
                    or not name.isprintable()), None)
        if bad is not None:
            raise serializers.ValidationError(f"{bad[:40]!r} is not a username.")
        return value

    def validate(self, attrs: dict) -> dict:
        if not attrs:
            raise serializers.ValidationError({"monthly_budget_usd": ["Give monthly_budget_usd, users or both."]})
        return attrs


class BudgetView(BillingView):
    """GET: this month's budget, spend, warning (>= 80%) and alerts, and the per-user budgets (admins: every
    member's; others: their own). PATCH (team admins): change the team's budget and/or members' budgets
    (`users`: {username: amount or null}); a name that is not a member of the team is a 400 on `users`."""

    renderer_classes = [JSONRenderer]

    def get_permissions(self):
        return [IsTenantAdmin()] if self.request.method not in ("GET", "HEAD", "OPTIONS") else [IsTenantMember()]

    def _body(self) -> dict:
        tenant = self.ctx.tenant
        now = timezone.now()
        month = month_of(now.date())
        status = budget_status(tenant=tenant, spent=month_to_date_spend(tenant=tenant, now=now))
        alerts = BudgetAlert.objects.filter(tenant=tenant, month=month).select_related("user")
        # A member or viewer sees their own budget line only; an admin every member's.
        own = None if self.ctx.is_admin else self.request.user.get_username()
        if own is not None:
            alerts = alerts.filter(Q(user__isnull=True) | Q(user__username=own))
        by_user: dict[str | None, list[dict]] = {}
        for a in alerts:
            by_user.setdefault(a.user.get_username() if a.user_id else None, []).append(
                {"threshold_pct": a.threshold_pct, "spent_usd": str(a.spent_usd), "budget_usd": str(a.budget_usd),
                 "at": a.created_at.isoformat()})
        users = [{**line, "alerts": by_user.get(line["user"], [])}
                 for line in user_budget_lines(tenant=tenant, now=now, username=own)]
        return {"team": tenant.slug, "month": month, **status, "alerts": by_user.get(None, []), "users": users}

    @extend_schema(operation_id="budget_read", responses={200: BudgetOutSerializer})
    def get(self, request: Request) -> Response:
        return Response(self._body())

    @extend_schema(operation_id="budget_change", request=BudgetInSerializer,
                   responses={200: BudgetOutSerializer, 400: FIELD_ERRORS})
    def patch(self, request: Request) -> Response:
        body = BudgetInSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        with transaction.atomic():  # both or neither
            if "users" in data:
                try:
                    user_budgets_set(tenant=self.ctx.tenant, budgets=data["users"])
                except BillingError as exc:
                    raise exceptions.ValidationError({exc.field: [str(exc)]}) from None
            if "monthly_budget_usd" in data:
                budget_set(tenant=self.ctx.tenant, monthly_budget_usd=data["monthly_budget_usd"])
        return Response(self._body())


def _spec_serializer():
    from broker.jobs.spec import JobSpecSerializer

    return JobSpecSerializer


class QuoteThrottle(JobSubmitThrottle):
    """A quote runs the engine several times: per token, WHALEZEN_QUOTE_RATE (default 60/min)."""

    scope = "quote"
    rate = os.environ.get("WHALEZEN_QUOTE_RATE", "60/min")

    def get_rate(self) -> str:
        return self.rate


class QuoteView(BillingView):
    """POST a job spec (as for POST /jobs/): the cheapest places it could run now, nothing is submitted."""

    permission_classes = [IsTenantReader]
    renderer_classes = [JSONRenderer]
    throttle_classes = [QuoteThrottle]

    @extend_schema(operation_id="quotes_create", request=_spec_serializer(),
                   responses={200: QuoteOutSerializer, 400: FIELD_ERRORS, 429: THROTTLED})
    def post(self, request: Request) -> Response:
        from broker.billing.quotes import quote
        from broker.jobs.intake import submission_parse

        submission = submission_parse(request.data, tenant=self.ctx.tenant)  # any format /jobs/ takes
        return Response(quote(tenant=self.ctx.tenant, validated=submission.validated,
                              user=request.user.get_username()))
