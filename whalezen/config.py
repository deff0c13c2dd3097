"""Where `whalezen login` keeps the server and token, and how a login is chosen.

The file is `$XDG_CONFIG_HOME/whalezen/config.json` (default `~/.config/whalezen/config.json`), written
with mode 0600 in a 0700 folder, by a rename so a reader never sees half of it. `WHALEZEN_URL` and
`WHALEZEN_TOKEN` override what it holds (each on its own).
"""
from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


class NotLoggedIn(Exception):
    pass


@dataclass(frozen=True)
class Login:
    url: str
    token: str | None
    source: str  # where they came from, for messages: "environment", the config file's path, ...


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or ""
    root = Path(base) if base and Path(base).is_absolute() else Path(env.get("HOME") or Path.home()) / ".config"
    return root / "whalezen" / "config.json"


def load(env: Mapping[str, str] | None = None) -> dict:
    path = config_path(env)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def too_open(env: Mapping[str, str] | None = None) -> bool:
    """Whether the stored login is readable by others (someone copied it around with a loose mode)."""
    try:
        mode = config_path(env).stat().st_mode
    except FileNotFoundError:
        return False
    return bool(mode & (stat.S_IRWXG | stat.S_IRWXO))


def save(url: str, token: str, env: Mapping[str, str] | None = None) -> Path:
    path = config_path(env)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    data = load(env) | {"url": url, "token": token}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".json")  # created 0600
    try:
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), 0o600)
            json.dump(data, out, indent=2)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def forget(env: Mapping[str, str] | None = None) -> bool:
    path = config_path(env)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def resolve_login(env: Mapping[str, str] | None = None, *, url: str | None = None) -> Login:
    """The login to use: `url` (a command-line flag), then WHALEZEN_URL / WHALEZEN_TOKEN, then the file."""
    env = os.environ if env is None else env
    stored = load(env)
    chosen_url = url or env.get("WHALEZEN_URL") or stored.get("url")
    if not chosen_url:
        raise NotLoggedIn("not logged in: run `whalezen login URL` or set WHALEZEN_URL and WHALEZEN_TOKEN")
    token = env.get("WHALEZEN_TOKEN")
    if not token and stored.get("token") and _same_server(str(chosen_url), str(stored.get("url") or "")):
        token = stored["token"]  # the stored token goes only to the server it was stored for
    source = "environment" if env.get("WHALEZEN_TOKEN") or env.get("WHALEZEN_URL") else str(config_path(env))
    return Login(url=str(chosen_url), token=str(token) if token else None, source=source)


def _same_server(a: str, b: str) -> bool:
    from whalezen.client import normalise_url

    try:
        return normalise_url(a) == normalise_url(b)
    except ValueError:
        return False
