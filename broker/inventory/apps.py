from django.apps import AppConfig


class InventoryConfig(AppConfig):
    name = "broker.inventory"
    label = "inventory"
