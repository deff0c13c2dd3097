"""The costs page: the figures cost_report gives (a metered week: tests/broker/test_billing_week.py),
by day, GPU model, pool and provider; the CSV for the session's team; statements for admins; the budget
and its 80% warning; bad form values in the API's words; another team's figures absent."""
from __future__ import annotations

import csv
import io
import time
from html import unescape
from datetime import date
from decimal import Decimal

import pytest

from broker.billing.selectors import cost_report
from broker.tenancy.models import Quota
from tests.broker.test_billing_week import frozen_clock, replay_week

from .conftest import Browser, text_of

NOVEMBER = "from=2026-11-01&to=2026-12-01"


@pytest.fixture
def week(acme, globex):
    """The replayed week, with the clock left on the next Monday (2026-11-09) for the requests."""
    with frozen_clock() as clock:
        replay_week(clock, acme, globex)
        yield clock


def _report(acme, group_by, user=None):
    return cost_report(tenant=acme.tenant, start=date(2026, 11, 1), end=date(2026, 12, 1), group_by=group_by,
                       user=user)


def test_the_page_shows_cost_reports_totals_and_breakdowns(acme, week, as_admin):
    resp = as_admin.get(f"/costs/?{NOVEMBER}&group_by=provider")
    assert resp.status_code == 200
    text = text_of(resp)
    assert "$128.54" in text  # the week's total, idle included (test_the_metered_week_to_the_cent)
    assert "Spend 2026-11-01 – 2026-11-30" in text  # `to` is exclusive: the heading names the last day counted
    for key in ("gpu_model", "pool", "provider"):
        for row in _report(acme, [key]):
            assert str(row[key]) in text and row["cost"] in text
    # The table, grouped as asked, is cost_report's rows and their total in the footer.
    table = resp.content.decode().split('id="h-cost-table"', 1)[1]
    for row in _report(acme, ["provider"]):
        assert f'<td class="name">{row["provider"]}</td>' in table and row["cost"] in table
    assert "<strong>128.54</strong>" in table
    # Charts: per day stacked by GPU model, with the JSON it draws from.
    html = resp.content.decode()
    assert 'data-stacked="true"' in html and 'id="cost-daily"' in html and '"2026-11-04"' in html
    assert 'style="' not in html


def test_a_member_sees_the_costs_of_their_own_jobs_only(acme, week, as_member):
    text = text_of(as_member.get(f"/costs/?{NOVEMBER}"))
    own = _report(acme, ["team"], user="acme-member")[0]["cost"]
    assert own == "10.00"  # j4 (tests/broker/test_billing_week.py)
    # The budget is the team's (as GET /api/v1/budget/ answers members); the report is the member's own.
    budget, report = text.split("Period and grouping", 1)
    assert "$128.54" in budget and "your jobs" in text
    assert f"${own}" in report and "128.54" not in report
    assert "Statements" not in text


def test_the_csv_link_answers_csv_for_the_session_user(acme, week, as_admin):
    page = as_admin.get(f"/costs/?{NOVEMBER}&group_by=day&group_by=gpu_model").content.decode()
    assert 'href="/costs/export.csv?from=2026-11-01&amp;to=2026-12-01&amp;group_by=day&amp;group_by=gpu_model"' in page
    resp = as_admin.get(f"/costs/export.csv?{NOVEMBER}&group_by=day&group_by=gpu_model")
    assert resp.status_code == 200 and resp["Content-Type"].startswith("text/csv")
    assert "attachment" in resp["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(resp.content.decode())))
    assert rows == [{k: ("" if v is None else str(v)) for k, v in r.items()} for r in _report(acme, ["day", "gpu_model"])]
    assert sum(Decimal(r["cost"]) for r in rows) == Decimal("128.54")
    bad = as_admin.get("/costs/export.csv?from=nope")
    assert bad.status_code == 400 and "'nope' is not a date" in bad.content.decode()  # CSV: field,reason


@pytest.mark.parametrize("query, field, words", [
    ("from=nope", "from", "'nope' is not a date: use YYYY-MM-DD."),
    ("from=2026-11-05&to=2026-11-01", "to", "must be after 'from'"),
    ("from=2020-01-01&to=2026-01-01", "to", "At most 400 days per report."),
    ("group_by=planet", "group_by", "Unknown key 'planet'"),
    ("group_by=day&group_by=day", "group_by", "A key is given twice."),
    ("from=" + "9" * 5000, "from", "is not a date"),
])
def test_bad_form_values_are_400_with_the_apis_words_next_to_the_field(acme, as_admin, query, field, words):
    resp = as_admin.get(f"/costs/?{query}")
    assert resp.status_code == 400
    html = unescape(resp.content.decode())
    assert words in html and f'id="err-{field}"' in html and len(html) < 40000


def test_statements_are_listed_and_open_for_admins_only(acme, week, as_admin, as_member, as_viewer):
    text = text_of(as_admin.get("/costs/"))
    assert "Statements" in text and "2026-11" in text
    statement = as_admin.get("/costs/statements/2026-11/")
    assert statement.status_code == 200 and "$128.54" in text_of(statement) and "j3-shared" in text_of(statement)
    as_csv = as_admin.get("/costs/statements/2026-11/?format=csv")
    assert as_csv["Content-Type"].startswith("text/csv")
    lines = list(csv.DictReader(io.StringIO(as_csv.content.decode())))
    assert sum(Decimal(ln["amount_usd"]) for ln in lines) == Decimal("128.54")
    assert as_admin.get("/costs/statements/2026-10/").status_code == 404  # nothing then
    assert as_admin.get("/costs/statements/pools/").status_code == 404
    assert as_member.get("/costs/statements/2026-11/").status_code == 403
    assert as_viewer.get("/costs/statements/2026-11/").status_code == 403


def test_another_team_sees_none_of_acmes_figures(acme, globex, week, as_other_team):
    resp = as_other_team.get(f"/costs/?{NOVEMBER}")
    assert resp.status_code == 200 and "128.54" not in resp.content.decode()
    assert "j3-shared" not in text_of(as_other_team.get("/costs/statements/2026-11/"))
    rows = list(csv.DictReader(io.StringIO(as_other_team.get(f"/costs/export.csv?{NOVEMBER}&group_by=pool")
                                           .content.decode())))
    assert rows and all(r["pool"].startswith("globex/") for r in rows)


def test_the_budget_and_its_80_percent_warning(acme, as_viewer):
    from broker.jobs.models import Allocation
    from broker.jobs.services import GpuRequest, allocation_commit
    from django.utils import timezone
    from datetime import timedelta

    from tests.broker.test_api_tenancy import submit

    text = text_of(as_viewer.get("/costs/"))
    assert "no monthly budget is set" in text
    now = timezone.now()
    month_start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    if now - month_start < timedelta(seconds=2):
        time.sleep(2)  # the month's first seconds: let some of it pass, so something is spent this month
        now = timezone.now()
    start = max(now - timedelta(hours=1), month_start)
    seconds = int(now.timestamp()) - int(start.timestamp())
    # Early in a month (under an hour in) the rate is raised so the held time still costs dollars.
    rate = Decimal("10") if seconds >= 600 else Decimal("3600")
    pool = acme.pool
    pool.gpu_hour_rate_usd = rate
    pool.save()
    job = submit(acme, resources={"gpus": 2})
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0, 1))])
    Allocation.objects.filter(job=job).update(created_at=start)
    held = Decimal(seconds) / 3600 * 2 * rate
    Quota.objects.filter(tenant=acme.tenant).update(monthly_budget_usd=(held / Decimal("0.9")).quantize(Decimal("0.01")))
    resp = as_viewer.get("/costs/")
    text = text_of(resp)
    assert "80% of the monthly budget is spent" in text and "% used" in text
    assert 'class="fill warn"' in resp.content.decode()


def test_a_visitor_is_sent_to_log_in(db):
    for path in ("/costs/", "/costs/export.csv", "/costs/statements/2026-11/"):
        resp = Browser().get(path)
        assert resp.status_code == 302 and resp.url.startswith("/login/"), path


def test_one_jobs_cost_is_its_row_of_the_teams_report(acme, week):
    """The job page asks billing for one job's lines only (job_id): the same figures as the team's report."""
    by_job = {row["job"]: row for row in _report(acme, ["job"]) if row["job"] != "__idle__"}
    assert len(by_job) >= 2
    for job_id, row in by_job.items():
        (alone,) = cost_report(tenant=acme.tenant, start=date(2026, 11, 1), end=date(2026, 12, 1),
                               group_by=["job"], job_id=job_id)
        assert alone == row
