"""Log in, log out, switch team. Logins go through django-axes like the admin's (locked out after
WHALEZEN_LOGIN_FAILURE_LIMIT failures for one username from one address)."""
from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from broker.console.access import SESSION_TEAM_KEY, console_page, with_policy
from broker.tenancy.models import Membership


class LoginView(auth_views.LoginView):
    template_name = "console/login.html"
    redirect_authenticated_user = True

    def dispatch(self, request, *args, **kwargs):
        return with_policy(super().dispatch(request, *args, **kwargs))


class LogoutView(auth_views.LogoutView):
    """POST only (Django's own rule): a link or an image cannot log anyone out."""

    next_page = "console:login"


@require_POST
@console_page
def team_switch(request: HttpRequest) -> HttpResponse:
    """Show another of the user's teams; a team they do not belong to is ignored (the page stays)."""
    raw = request.POST.get("team", "")
    if raw.isascii() and raw.isdigit() and len(raw) <= 18 and Membership.objects.filter(user=request.user, tenant_id=int(raw)).exists():
        request.session[SESSION_TEAM_KEY] = int(raw)
    return redirect("console:dashboard")
