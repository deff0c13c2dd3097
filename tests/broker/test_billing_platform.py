"""Platform admins (Django superusers) read every team's costs and statements through the API with
`?team=<slug>` or `?team=all`; nobody else can name another team, or learn whether one exists."""
from __future__ import annotations

from collections import defaultdict
from datetime import date
from decimal import Decimal

import pytest

from broker.billing.selectors import cost_report

from .conftest import make_world
from .test_billing_week import frozen_clock, replay_week

NOVEMBER = "from=2026-11-01&to=2026-12-01"


@pytest.fixture
def platform(gpu_models):
    """The platform's own team; its admin is the superuser who runs /admin/."""
    world = make_world("platform", gpu_models)
    world.admin.is_superuser = True
    world.admin.save(update_fields=["is_superuser"])
    return world


@pytest.fixture
def november(gpu_models, acme, globex):
    globex.pool.gpu_hour_rate_usd = Decimal("3.00")  # globex's one GPU-hour is charged too
    globex.pool.save()
    with frozen_clock() as clock:
        replay_week(clock, acme, globex)
        yield clock


def test_a_platform_admin_reads_every_team_and_the_figures_add_up(platform, acme, globex, november):
    body = platform.client.get(f"/api/v1/costs/?{NOVEMBER}&team=all&group_by=team").json()
    assert body["scope"] == "platform"
    assert {r["team"]: r["cost"] for r in body["rows"]} == {"acme": "128.54", "globex": "3.00"}
    # Grouped by no team, each row is the sum of the teams' rows: the whole platform's spend per model.
    merged = platform.client.get(f"/api/v1/costs/?{NOVEMBER}&team=all&group_by=provider,gpu_model").json()["rows"]
    expected: dict[tuple, Decimal] = defaultdict(Decimal)
    for world in (acme, globex):
        for row in world.client.get(f"/api/v1/costs/?{NOVEMBER}&group_by=provider,gpu_model").json()["rows"]:
            expected[(row["provider"], row["gpu_model"])] += Decimal(row["cost"])
    assert {(r["provider"], r["gpu_model"]): Decimal(r["cost"]) for r in merged} == expected
    assert expected[("onprem", "A100-80GB")] == Decimal("35.50")  # acme's 32.50 and globex's 3.00
    csv_lines = platform.client.get(f"/api/v1/costs/?{NOVEMBER}&team=all&group_by=team&format=csv")
    assert csv_lines.content.decode().splitlines()[1:] == [
        ",".join(str(v) if v is not None else "" for v in row.values()) for row in body["rows"]]


def test_a_platform_admin_reads_one_team_as_its_admin_does(platform, acme, globex, november):
    as_platform = platform.client.get(f"/api/v1/costs/?{NOVEMBER}&team=acme&group_by=job,user").json()
    as_team = acme.client.get(f"/api/v1/costs/?{NOVEMBER}&group_by=job,user").json()
    assert as_platform["scope"] == "team acme" and as_platform["rows"] == as_team["rows"]
    statement = platform.client.get("/api/v1/statements/2026-11/?team=acme")
    assert statement.status_code == 200 and statement.json() == acme.client.get("/api/v1/statements/2026-11/").json()
    listed = platform.client.get("/api/v1/statements/?team=globex").json()["results"]
    assert [(s["month"], s["total_usd"]) for s in listed] == [("2026-11", "3.00")]
    csv_statement = platform.client.get("/api/v1/statements/2026-11/?team=globex&format=csv")
    assert csv_statement.status_code == 200 and "globex-job" in csv_statement.content.decode()


@pytest.mark.parametrize("path", ["/api/v1/costs/", "/api/v1/statements/", "/api/v1/statements/2026-11/"])
@pytest.mark.parametrize("team", ["globex", "all", "no-such-team"])
def test_nobody_else_may_name_another_team_and_existence_does_not_show(acme, globex, path, team):
    for client in (acme.client, acme.member_client, acme.viewer_client):
        resp = client.get(f"{path}?team={team}")
        assert resp.status_code == 403, (path, team, resp.content[:200])
        assert "globex" not in resp.content.decode() or team == "globex"
    # The same answer for a team that exists and one that does not.
    assert acme.client.get(f"{path}?team=globex").json() == acme.client.get(f"{path}?team=no-such-team").json()


def test_naming_ones_own_team_changes_nothing(acme, november):
    assert (acme.client.get(f"/api/v1/costs/?{NOVEMBER}&team=acme").json()
            == acme.client.get(f"/api/v1/costs/?{NOVEMBER}").json())
    mine = acme.member_client.get(f"/api/v1/costs/?{NOVEMBER}&team=acme").json()
    assert mine["scope"] == "user acme-member"  # a member still reads only their own jobs


def test_a_platform_admins_bad_team_is_a_400_naming_the_field(platform):
    for query in ("team=no-such-team", "team=" + "x" * 5000):
        resp = platform.client.get(f"/api/v1/costs/?{query}")
        assert resp.status_code == 400 and list(resp.json()) == ["team"] and len(resp.content) < 300
    resp = platform.client.get("/api/v1/statements/2026-11/?team=all")
    assert resp.status_code == 400 and "one team's" in resp.json()["team"][0]


def test_a_superuser_who_is_only_a_viewer_of_a_team_still_reads_statements(platform, acme, november):
    platform.viewer.is_superuser = True
    platform.viewer.save(update_fields=["is_superuser"])
    assert platform.viewer_client.get("/api/v1/statements/?team=acme").status_code == 200
    assert platform.member_client.get("/api/v1/statements/?team=acme").status_code == 403  # not a superuser


def test_the_report_of_several_teams_is_the_sum_of_their_reports(acme, globex, november):
    window = {"start": date(2026, 11, 1), "end": date(2026, 12, 1), "group_by": ["day"]}
    together = cost_report(tenants=[acme.tenant, globex.tenant], **window)
    totals: dict[str, Decimal] = defaultdict(Decimal)
    for team in (acme.tenant, globex.tenant):
        for row in cost_report(tenant=team, **window):
            totals[row["day"]] += Decimal(row["cost"])
    assert len(totals) > 1 and {r["day"]: Decimal(r["cost"]) for r in together} == totals
