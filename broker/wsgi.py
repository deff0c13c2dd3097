"""WSGI entry point (gunicorn broker.wsgi)."""
import gc
import importlib
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "broker.settings")
application = get_wsgi_application()


def _freeze_what_the_application_loaded() -> None:
    """Load the URL configuration (views, serializers, the schema) now rather than on the first request,
    then move everything loaded so far out of the garbage collector's sight (`gc.freeze`): it lives as
    long as the process. Otherwise every full collection walks those few hundred thousand objects again:
    measured in the web server's workers under the submission benchmark, 50-98 ms each, the requests they
    interrupt were the slowest 1% (bench/README.md §10)."""
    from django.conf import settings

    importlib.import_module(settings.ROOT_URLCONF)
    gc.collect()  # what is garbage now should not be kept forever
    gc.freeze()


_freeze_what_the_application_loaded()
