from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "broker.jobs"
    label = "jobs"
