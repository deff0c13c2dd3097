"""The Celery application. Tasks carry only ids; Postgres holds the truth (see DESIGN.md)."""
from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "broker.settings")

app = Celery("whalezen")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
