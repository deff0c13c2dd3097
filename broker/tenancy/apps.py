from django.apps import AppConfig


class TenancyConfig(AppConfig):
    name = "broker.tenancy"
    label = "tenancy"
