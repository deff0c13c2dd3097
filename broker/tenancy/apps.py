from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps


class TenancyConfig(AppConfig):
    name = "broker.tenancy"
    label = "tenancy"


class OperatorAdminConfig(admin_apps.AdminConfig):
    """django.contrib.admin whose `admin.site` lets in superusers only (see admin_site.py)."""

    default = False  # not broker.tenancy's own config: INSTALLED_APPS names it in place of django.contrib.admin
    default_site = "broker.tenancy.admin_site.OperatorAdminSite"
