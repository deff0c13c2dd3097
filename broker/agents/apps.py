from django.apps import AppConfig


class AgentsConfig(AppConfig):
    name = "broker.agents"
    label = "agents"
    verbose_name = "Node agents"
