"""The dashboard: what the team holds, what waits and why, what it spends."""
from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from broker.console import selectors
from broker.console.access import console_page


@console_page
def dashboard(request: HttpRequest) -> HttpResponse:
    data = selectors.dashboard(tenant=request.console.tenant)
    chart = {"labels": list(data["gpus_by_model"]), "values": list(data["gpus_by_model"].values())}
    template = "console/partials/dashboard_body.html" if request.htmx else "console/dashboard.html"
    return render(request, template, {**data, "chart": chart, "nav": "dashboard"})
