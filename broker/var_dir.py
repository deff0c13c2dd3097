"""Where the broker keeps its files (the embedded database, logs, the demo agents' folders): one function,
for the settings and for what must know it without loading them (broker/ops/gunicorn_conf.py runs before
the web server's processes load the settings, which read what it sets)."""
from __future__ import annotations

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent


def var_dir() -> Path:
    return Path(os.environ.get("WHALEZEN_VAR_DIR", BASE_DIR / "var"))
