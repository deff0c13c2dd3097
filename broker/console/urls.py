"""The console's pages (templates in the top-level templates/console/)."""
from django.urls import path

from broker.console.views import auth, dashboard

app_name = "console"

urlpatterns = [
    path("", dashboard.dashboard, name="dashboard"),
    path("login/", auth.LoginView.as_view(), name="login"),
    path("logout/", auth.LogoutView.as_view(), name="logout"),
    path("team/switch/", auth.team_switch, name="team-switch"),
]
