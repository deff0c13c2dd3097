from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    """The web console: server-rendered pages over the same services and selectors as the API."""

    name = "broker.console"
    label = "console"
