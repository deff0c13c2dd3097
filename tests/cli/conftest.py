"""Fixtures for the CLI tests: a live broker (pytest-django's `live_server`, real HTTP) with the broker
tests' two tenants, and `wz`, which runs the `whalezen` CLI in-process with its own config folder."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.broker.conftest import _fresh_cache, acme, globex, gpu_models  # noqa: F401  (fixtures)
from whalezen.cli import main

REPO = Path(__file__).resolve().parents[2]
WHALEZEN = Path(sys.executable).parent / "whalezen"  # the console script `make test` installs


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture
def home(tmp_path) -> dict[str, str]:
    """An environment with no login: its own HOME and XDG_CONFIG_HOME, no WHALEZEN_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHALEZEN_")}
    env.update(HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    return env


class Wz:
    def __init__(self, env: dict[str, str], url: str | None, token: str | None) -> None:
        self.env, self.url, self.token = env, url, token

    def environment(self, **overrides: str | None) -> dict[str, str]:
        env = dict(self.env)
        if self.url:
            env["WHALEZEN_URL"] = self.url
        if self.token:
            env["WHALEZEN_TOKEN"] = self.token
        for key, value in overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def __call__(self, *argv: str, **overrides: str | None) -> Result:
        out, err = io.StringIO(), io.StringIO()
        code = main(list(argv), env=self.environment(**overrides), stdout=out, stderr=err)
        return Result(code, out.getvalue(), err.getvalue())

    def process(self, *argv: str, **overrides: str | None) -> subprocess.Popen:
        """The installed `whalezen` script as a process of its own (output as text pipes)."""
        return subprocess.Popen([str(WHALEZEN), *argv], env=self.environment(**overrides), cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)


@pytest.fixture
def wz(live_server, acme, home) -> Wz:
    """The CLI as acme's admin (WHALEZEN_URL / WHALEZEN_TOKEN), against the live server."""
    return Wz(home, live_server.url, acme.token_secret)


@pytest.fixture
def spec_file(tmp_path):
    def write(text: str, name: str = "job.yaml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)
    return write
