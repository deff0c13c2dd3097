"""/costs/: what the team spends, over time and by GPU model, pool and provider; statements; budget.

Every figure comes from the billing reads the API uses (broker.billing.selectors.cost_report,
statements.statements_list/statement_get/budget_status) with the API's scope
rule: a team admin sees the whole team, anyone else the costs of their own jobs (and no statements).
The from/to/group_by form goes through the API's own parser (parse_cost_params), so a bad value is
refused in the API's words. Savings (broker.billing.savings) are not shown: they ask every cloud
pool's provider for offers, too slow and fragile for a page (a misconfigured pool raises). CSV is rendered by the API's CSVRenderer, here on console routes so that it
is the team chosen in the console (the API's session login always reads the user's first team).
"""
from __future__ import annotations

from datetime import date, timedelta

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from rest_framework.exceptions import ValidationError

from broker.billing.api import CSVRenderer, parse_cost_params
from broker.billing.metering import month_of
from broker.billing.selectors import GROUP_FIELDS, cost_report, month_to_date_spend
from broker.billing.services import BillingError
from broker.billing.statements import budget_status, statement_get, statements_list, user_budget_lines
from broker.console.access import console_page

DEFAULT_GROUP_BY = "gpu_model,provider,pool"
BREAKDOWNS = (("gpu_model", "GPU model"), ("pool", "pool"), ("provider", "provider"))


def _user_filter(request: HttpRequest) -> str | None:
    """As the API's BillingView.user_filter: None (whole team) for an admin, else the caller's own jobs."""
    return None if request.console.is_admin else request.user.get_username()


def _params(request: HttpRequest) -> dict[str, str]:
    """The form's values as the API's query parameters (group_by: checkboxes joined by commas)."""
    picked = [g for g in request.GET.getlist("group_by") if g != ""]
    return {"from": request.GET.get("from", ""), "to": request.GET.get("to", ""),
            "group_by": ",".join(picked) if picked else ("" if "group_by" in request.GET else DEFAULT_GROUP_BY)}


def _parse(params: dict) -> tuple[tuple[date, date, list[str]] | None, dict[str, list[str]]]:
    try:
        return parse_cost_params(params), {}
    except ValidationError as exc:
        return None, {field: [str(m) for m in messages] for field, messages in exc.detail.items()}


def _series(rows: list[dict], key: str) -> dict:
    return {"labels": [str(r[key]) for r in rows], "values": [float(r["cost"]) for r in rows]}


def _daily(rows: list[dict]) -> dict:
    """Rows grouped by (day, gpu_model) -> a stacked bar chart: one dataset per GPU model."""
    days = sorted({r["day"] for r in rows})
    models = sorted({str(r["gpu_model"]) for r in rows})
    cost = {(r["day"], str(r["gpu_model"])): float(r["cost"]) for r in rows}
    return {"labels": days, "datasets": [{"label": m, "data": [cost.get((d, m), 0.0) for d in days]} for m in models]}


@console_page
def costs(request: HttpRequest) -> HttpResponse:
    params = _params(request)
    parsed, errors = _parse(params)
    tenant, user = request.console.tenant, _user_filter(request)
    context: dict = {"nav": "costs", "params": params, "errors": errors, "group_fields": list(GROUP_FIELDS),
                     "picked": params["group_by"].split(","), "scope": "team" if user is None else f"your jobs ({user})"}
    now = timezone.now()
    context["budget"] = budget_status(tenant=tenant, spent=month_to_date_spend(tenant=tenant, now=now))
    # Per-user budgets: an admin sees every member's line, anyone else their own (as GET /api/v1/budget/).
    context["user_budgets"] = user_budget_lines(
        tenant=tenant, now=now, username=None if request.console.is_admin else request.user.get_username())
    context["month"] = month_of(now.date())
    if request.console.is_admin:
        context["statements"] = statements_list(tenant=tenant, now=now)
    if parsed is None:
        return render(request, "console/costs.html", context, status=400)
    start, end, group_by = parsed

    def report(keys: list[str]) -> list[dict]:
        return cost_report(tenant=tenant, start=start, end=end, group_by=keys, user=user, now=now)

    table = [{**r, "cells": [r[g] for g in group_by]} for r in report(group_by)]
    breakdowns = []
    for key, label in BREAKDOWNS:
        rows = report([key])
        breakdowns.append({"key": key, "label": label, "source": f"cost-by-{key}", "chart": _series(rows, key),
                           "rows": [{**r, "name": r[key]} for r in rows]})
    total = report(["team"])  # one row (or none): the window's totals (the team is the one key all rows share)
    # `end` is exclusive (the API's `to`); the heading names the last day counted.
    context.update(start=start, end=end, last_day=end - timedelta(days=1), group_by=group_by, rows=table, breakdowns=breakdowns,
                   total=total[0] if total else None, daily=_daily(report(["day", "gpu_model"])),
                   csv_query=request.GET.urlencode())
    return render(request, "console/costs.html", context)


def _csv(data: dict | list, *, filename: str, status: int = 200) -> HttpResponse:
    response = HttpResponse(CSVRenderer().render(data), content_type="text/csv; charset=utf-8", status=status)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


@console_page
def costs_csv(request: HttpRequest) -> HttpResponse:
    """The cost table as CSV, for the same form values (errors: one "field,reason" row each, 400)."""
    parsed, errors = _parse(_params(request))
    if parsed is None:
        return _csv(errors, filename="costs-error.csv", status=400)
    start, end, group_by = parsed
    rows = cost_report(tenant=request.console.tenant, start=start, end=end, group_by=group_by,
                       user=_user_filter(request))
    return _csv({"rows": rows}, filename=f"costs-{request.console.tenant.slug}-{start}-{end}.csv")


def _statement(request: HttpRequest, month: str) -> dict:
    """As the API's StatementDetailView: a bad month is 404 here (a link, not a form), so is an empty past one."""
    if len(month) != 7 or not all(c in "0123456789-" for c in month):
        raise Http404("Not a month.")
    try:
        statement = statement_get(tenant=request.console.tenant, month=month)
    except BillingError:
        raise Http404("Not a month.") from None
    if not statement["lines"] and statement["status"] == "open" and month != month_of(timezone.now().date()):
        raise Http404(f"No statement for {month}.")
    return statement


@console_page(admin=True)
def statement(request: HttpRequest, month: str) -> HttpResponse:
    data = _statement(request, month)
    if request.GET.get("format") == "csv":
        return _csv(data, filename=f"statement-{data['team']}-{month}.csv")
    return render(request, "console/costs_statement.html", {"nav": "costs", "st": data})
