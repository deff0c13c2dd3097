"""The Django admin is for platform operators (superusers) only.

The admin is not tenant-scoped: whoever may open a changelist sees every tenant's rows. Django lets any
active staff user in and then filters by model permissions, so a staff user given `view_job` saw all
tenants' jobs (issue 8, item 14). This site lets in active superusers only; tenant admins manage their
tenant through the API. It replaces `admin.site` (INSTALLED_APPS lists `apps.OperatorAdminConfig` instead
of `django.contrib.admin`), so every `@admin.register` lands here. Login attempts are throttled by
django-axes (settings: AXES_*).
"""
from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.forms import AdminAuthenticationForm
from django.core.exceptions import ValidationError
from django.http import HttpRequest


class OperatorAuthenticationForm(AdminAuthenticationForm):
    """Refuses staff users who are not superusers at login, with the same message as a wrong password
    (the page does not tell an attacker which accounts exist or what they may do)."""

    def confirm_login_allowed(self, user) -> None:
        super().confirm_login_allowed(user)
        if not user.is_superuser:
            raise ValidationError(self.error_messages["invalid_login"], code="invalid_login",
                                  params={"username": self.username_field.verbose_name})


class OperatorAdminSite(admin.AdminSite):
    site_header = "WhaleZen operations"
    site_title = "WhaleZen admin"
    login_form = OperatorAuthenticationForm

    def has_permission(self, request: HttpRequest) -> bool:
        user = request.user
        return user.is_active and user.is_superuser
