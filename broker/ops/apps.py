from django.apps import AppConfig


class OpsConfig(AppConfig):
    name = "broker.ops"
    label = "ops"
