from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "broker.billing"
    label = "billing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from broker.billing import signals  # noqa: F401  (fixes an allocation's price at commit)
