"""Per-user monthly budgets (issue 13), as a user meets them: a team admin sets and clears a member's budget
through /api/v1/budget/, members see their own line only, bad input is a 400 naming `users`, another team's
people are not revealed; the 80% warning and its alert; at 100% the member's new job waits with the numbers
while a teammate's is placed and the member's running job keeps running; raising the budget places it."""
from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from broker.billing.models import BudgetAlert, UserBudget
from broker.billing.services import meter
from broker.jobs.models import Allocation, Job
from broker.jobs.services import GpuRequest, allocation_commit
from broker.jobs.states import JobState
from broker.scheduler.services import scheduling_cycle_run
from broker.tenancy.models import Quota
from tests.console.conftest import Browser, text_of

from .conftest import MINIMAL_SPEC
from .test_billing_week import run

CENT = Decimal("0.01")


def patch(client, body):
    return client.patch("/api/v1/budget/", body, format="json")


def lines(client) -> dict[str, dict]:
    resp = client.get("/api/v1/budget/")
    assert resp.status_code == 200, resp.content[:300]
    return {line["user"]: line for line in resp.json()["users"]}


def submit_as(client, **resources) -> Job:
    resp = client.post("/api/v1/jobs/", {**MINIMAL_SPEC, "resources": {"gpus": 1, **resources}}, format="json")
    assert resp.status_code == 201, resp.content[:300]
    return Job.objects.get(pk=resp.json()["id"])


def running_for_hours(world, job: Job, *, gpus: tuple[int, ...], hours: int = 4) -> Decimal:
    """Hold `gpus` of the first node for the last `hours` (within this month), run the job, meter; return
    what that costs at the pool's chargeback rate."""
    allocation_commit(job=job, requests=[GpuRequest(node=world.nodes[0], gpu_indices=gpus)])
    now = timezone.now()
    start = max(now - timedelta(hours=hours), now.replace(day=1, hour=0, minute=0, second=0, microsecond=0))
    Allocation.objects.filter(job=job).update(created_at=start)
    run(job)
    held_h = Decimal(int(now.timestamp()) - int(start.timestamp())) / 3600
    meter(now=now)
    return (len(gpus) * held_h * Decimal(world.pool.gpu_hour_rate_usd)).quantize(CENT)


@pytest.fixture
def charged(acme):
    """$2.50/GPU-h chargeback for billing; $1/GPU-h marginal cost, so the engine sees a placement on the
    team's nodes as spending (the rule of the team budget)."""
    acme.pool.gpu_hour_rate_usd = Decimal("2.50")
    acme.pool.marginal_cost_usd_per_gpu_hour = Decimal("1.00")
    acme.pool.save()
    return acme


def test_an_admin_sets_and_clears_a_members_budget_and_members_see_only_their_own(acme):
    for client in (acme.member_client, acme.viewer_client):
        assert patch(client, {"users": {"acme-member": "50"}}).status_code == 403
    assert not UserBudget.objects.exists()
    resp = patch(acme.client, {"users": {"acme-member": "50", "acme-viewer": "7.5"}})
    assert resp.status_code == 200, resp.content
    assert resp.json()["monthly_budget_usd"] is None  # the team's budget is untouched
    line = lines(acme.client)["acme-member"]
    assert line == {"user": "acme-member", "monthly_budget_usd": "50.00", "spent_usd": "0.00",
                    "remaining_usd": "50.00", "used_pct": 0.0, "warning": False, "exceeded": False, "alerts": []}
    assert set(lines(acme.client)) == {"acme-member", "acme-viewer"}
    assert set(lines(acme.member_client)) == {"acme-member"}
    assert set(lines(acme.viewer_client)) == {"acme-viewer"}
    # Raise one, clear the other.
    assert patch(acme.client, {"users": {"acme-member": "80", "acme-viewer": None}}).status_code == 200
    assert {u: l["monthly_budget_usd"] for u, l in lines(acme.client).items()} == {"acme-member": "80.00"}
    assert lines(acme.viewer_client) == {}
    # Both at once: the team's and a member's.
    assert patch(acme.client, {"monthly_budget_usd": "500", "users": {"acme-admin": "20"}}).status_code == 200
    assert Quota.objects.get(tenant=acme.tenant).monthly_budget_usd == Decimal("500.00")
    assert set(lines(acme.client)) == {"acme-member", "acme-admin"}


@pytest.mark.parametrize("body", [
    {"users": {"acme-member": "-5"}}, {"users": {"acme-member": "lots"}}, {"users": ["acme-member"]},
    {"users": "acme-member"}, {"users": {}}, {"users": {"acme-member": "1e30"}},
    {"users": {f"u{i}": "1" for i in range(201)}}, {"users": {"x" * 10_000: "1"}}, {"users": {"a\nb": "1"}},
    {"users": {"": "1"}}, {"users": {"acme-member": {"usd": 5}}},
])
def test_bad_user_budgets_are_400_naming_users(acme, body):
    resp = patch(acme.client, body)
    assert resp.status_code == 400, resp.content[:300]
    assert "users" in resp.json() and len(resp.content) < 1000
    assert not UserBudget.objects.exists()


def test_an_empty_patch_is_400_and_a_bad_user_changes_nothing(acme):
    resp = patch(acme.client, {})
    assert resp.status_code == 400 and "monthly_budget_usd" in resp.json()
    resp = patch(acme.client, {"monthly_budget_usd": "10", "users": {"acme-member": "5", "nobody": "5"}})
    assert resp.status_code == 400 and resp.json() == {"users": ["'nobody' is not a member of this team."]}
    assert not UserBudget.objects.exists()
    assert Quota.objects.get(tenant=acme.tenant).monthly_budget_usd is None  # all or nothing


def test_another_teams_user_is_refused_like_a_stranger(acme, globex):
    theirs = patch(acme.client, {"users": {"globex-member": "5"}})
    stranger = patch(acme.client, {"users": {"globex-nobody": "5"}})
    assert theirs.status_code == stranger.status_code == 400
    assert theirs.json()["users"][0].replace("globex-member", "X") == stranger.json()["users"][0].replace(
        "globex-nobody", "X")
    assert not UserBudget.objects.exists()
    # Globex's own budgets are not in acme's answer, and acme's not in globex's.
    assert patch(globex.client, {"users": {"globex-member": "5"}}).status_code == 200
    assert lines(acme.client) == {} and set(lines(globex.client)) == {"globex-member"}


def test_the_80_percent_warning_and_alert_of_a_member(charged):
    acme = charged
    job = submit_as(acme.member_client, gpus=2)
    expected = running_for_hours(acme, job, gpus=(0, 1))
    assert expected > 0
    budget = (expected * 100 / 85).quantize(CENT)  # ~85% used
    assert patch(acme.client, {"users": {"acme-member": str(budget)}}).status_code == 200
    before = lines(acme.member_client)["acme-member"]
    assert before["warning"] is True and before["exceeded"] is False and before["alerts"] == []
    meter(now=timezone.now())
    body = acme.member_client.get("/api/v1/budget/").json()
    (line,) = body["users"]
    assert Decimal(line["spent_usd"]) == pytest.approx(expected, abs=Decimal("0.02"))
    assert 80 <= line["used_pct"] < 100
    assert [a["threshold_pct"] for a in line["alerts"]] == [80] and line["alerts"][0]["budget_usd"] == str(budget)
    assert body["alerts"] == []  # the team's: none, it has no budget
    meter(now=timezone.now())
    assert BudgetAlert.objects.filter(tenant=acme.tenant, user=acme.member).count() == 1  # once a month
    assert BudgetAlert.objects.filter(tenant=acme.tenant, user__isnull=True).count() == 0
    # The console's budget card: the member reads their own line, the admin every member's.
    text = text_of(Browser(acme.member).get("/costs/"))
    assert "Your budget" in text and "acme-member" in text and "80% reached" in text
    assert patch(acme.client, {"users": {"acme-viewer": "3"}}).status_code == 200
    assert "acme-viewer" not in text_of(Browser(acme.member).get("/costs/"))
    admin_text = text_of(Browser(acme.admin).get("/costs/"))
    assert "Members' budgets" in admin_text and "acme-member" in admin_text and "acme-viewer" in admin_text


def test_a_spent_member_budget_holds_back_their_new_job_only(charged):
    acme = charged
    running = submit_as(acme.member_client, gpus=2)
    spent = running_for_hours(acme, running, gpus=(0, 1))
    monthly = max(CENT, (spent / 2).quantize(CENT))
    assert patch(acme.client, {"users": {"acme-member": str(monthly)}}).status_code == 200
    meter(now=timezone.now())
    assert lines(acme.member_client)["acme-member"]["exceeded"] is True
    alerts = BudgetAlert.objects.filter(user=acme.member).order_by("threshold_pct")
    assert [a.threshold_pct for a in alerts] == [80, 100]
    mine = submit_as(acme.member_client)
    teammates = submit_as(acme.client)
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert outcome.placed == [teammates.pk]
    reason = acme.member_client.get(f"/api/v1/jobs/{mine.pk}/").json()
    assert reason["state"] == "PENDING"
    assert reason["pending_reason"]["code"] == "BUDGET_EXCEEDED", reason["pending_reason"]
    assert (f"budget: user acme-member of acme has $0.00 left of ${monthly:,.2f} this month, cheapest fit costs "
            "$1.00") in reason["pending_reason"]["message"]
    running.refresh_from_db()
    assert running.state == JobState.RUNNING and running.allocations.filter(active=True).count() == 1
    # A quote for the member says the same; the admin's quote of the same spec still finds the node.
    spec = {"name": "q", "command": ["python", "t.py"], "resources": {"gpus": 1}}
    member_quote = acme.member_client.post("/api/v1/quotes/", spec, format="json").json()
    assert member_quote["options"] == [] and member_quote["unplaceable"][0]["code"] == "BUDGET_EXCEEDED"
    assert "user acme-member of acme" in member_quote["unplaceable"][0]["message"]
    assert acme.client.post("/api/v1/quotes/", spec, format="json").json()["options"]
    # Nothing changed: the next decision is skipped; the admin raising the budget decides it again.
    scheduling_cycle_run(tenant=acme.tenant)
    assert scheduling_cycle_run(tenant=acme.tenant).unchanged is True
    assert patch(acme.client, {"users": {"acme-member": "1000"}}).status_code == 200
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert not outcome.unchanged and outcome.placed == [mine.pk]
