from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "broker.scheduler"
    label = "scheduler"
