"""The web server's workers keep what the application loaded out of the garbage collector's sight
(broker/wsgi.py): a full collection then walks only what requests made, instead of every module,
class and URL pattern of the application (50-98 ms a collection in the gunicorn workers before,
the slowest 1% of submissions; bench/README.md §10). Run in a fresh interpreter: loading the
WSGI module freezes the process it is loaded in."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import gc, json, sys
import broker.wsgi
print(json.dumps({"frozen": gc.get_freeze_count(), "urlconf_loaded": "broker.urls" in sys.modules,
                  "tracked": len(gc.get_objects())}))
"""


def test_loading_the_wsgi_application_freezes_what_it_loaded(tmp_path):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "broker.settings", "WHALEZEN_VAR_DIR": str(tmp_path)}
    env.pop("DATABASE_URL", None)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    probe = json.loads(out.strip().splitlines()[-1])
    assert probe["urlconf_loaded"]  # the views and serializers are loaded before the freeze, not on a request
    # Most of what the application loaded is frozen; what a full collection still walks is a small rest.
    assert probe["frozen"] > 50_000 and probe["tracked"] < probe["frozen"] / 5, probe
