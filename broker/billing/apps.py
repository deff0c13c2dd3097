from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "broker.billing"
    label = "billing"
    default_auto_field = "django.db.models.BigAutoField"
