"""The console's pages (templates in the top-level templates/console/)."""
from django.urls import path

from broker.console.views import auth, costs, dashboard, jobs, nodes, submit, team

app_name = "console"

urlpatterns = [
    path("", dashboard.dashboard, name="dashboard"),
    path("login/", auth.LoginView.as_view(), name="login"),
    path("logout/", auth.LogoutView.as_view(), name="logout"),
    path("team/switch/", auth.team_switch, name="team-switch"),
    # Jobs, the job page and its actions, submit and its live quote (views/jobs.py, views/submit.py).
    path("jobs/", jobs.jobs_list, name="jobs"),
    path("jobs/<int:pk>/", jobs.job_page, name="job"),
    path("jobs/<int:pk>/cancel/", jobs.job_cancel, name="job-cancel"),
    path("jobs/<int:pk>/checkpoint/", jobs.job_checkpoint, name="job-checkpoint"),
    path("jobs/<int:pk>/migrate/", jobs.job_migrate, name="job-migrate"),
    path("submit/", submit.submit_page, name="submit"),
    path("submit/quote/", submit.quote_fragment, name="submit-quote"),
    # Nodes, costs (CSV, statements) and the team page (views/nodes.py, views/costs.py, views/team.py).
    path("nodes/", nodes.nodes, name="nodes"),
    path("costs/", costs.costs, name="costs"),
    path("costs/export.csv", costs.costs_csv, name="costs-csv"),
    path("costs/statements/<str:month>/", costs.statement, name="statement"),
    path("team/", team.team, name="team"),
    path("team/tokens/", team.token_create, name="team-token-create"),
    path("team/tokens/<int:token_id>/revoke/", team.token_revoke, name="team-token-revoke"),
    path("team/members/<int:membership_id>/role/", team.member_role, name="team-member-role"),
    path("team/budget/", team.budget, name="team-budget"),
]
