from django.apps import AppConfig


class ProvisioningConfig(AppConfig):
    name = "broker.provisioning"
    label = "provisioning"
