"""HTTP client for the broker's agent API (docs/agent.md), on urllib so nodes need no `requests`.

Failures are sorted by what the agent should do next:
- `BrokerUnavailable`: network error, timeout, 5xx, 429, garbage body: retry later with backoff.
- `BrokerAuthError`: 401/403: the token is wrong or revoked; retrying the same call cannot help.
- `BrokerRejected`: another 4xx: this one request is wrong (unknown assignment, bad state change);
  drop it, keep going.
"""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from agent import AGENT_VERSION

API_PREFIX = "/api/v1/agent"


class BrokerError(Exception):
    def __init__(self, message: str, *, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class BrokerUnavailable(BrokerError):
    pass


class BrokerAuthError(BrokerError):
    pass


class BrokerRejected(BrokerError):
    pass


class BrokerClient:
    def __init__(self, server_url: str, *, timeout_s: float = 10.0) -> None:
        if not server_url.startswith(("http://", "https://")):
            raise ValueError(f"server URL must start with http:// or https://, got {server_url!r}")
        self.base_url = server_url.rstrip("/") + API_PREFIX
        self.timeout_s = timeout_s

    # -- the four calls ----------------------------------------------------------------------
    def register(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/register", payload, token=None)

    def heartbeat(self, token: str, payload: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/heartbeat", payload, token=token)

    def assignments(self, token: str) -> dict[str, Any]:
        return self._request("GET", "/assignments", None, token=token)

    def report_status(self, token: str, assignment_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", f"/assignments/{assignment_id}/status", payload, token=token)

    # -- transport ---------------------------------------------------------------------------
    def _request(self, method: str, path: str, payload: dict[str, Any] | None, *, token: str | None) -> dict[str, Any]:
        url = self.base_url + path
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Accept": "application/json", "User-Agent": f"whalezen-agent/{AGENT_VERSION}"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if token:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
                status = response.status
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
            body = _decode(raw)
            detail = _detail(body)
            message = f"{method} {path}: HTTP {status}{': ' + detail if detail else ''}"
            if status in (401, 403):
                raise BrokerAuthError(message, status=status, body=body) from None
            if status == 429 or status >= 500:
                raise BrokerUnavailable(message, status=status, body=body) from None
            raise BrokerRejected(message, status=status, body=body) from None
        except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise BrokerUnavailable(f"{method} {path}: broker unreachable ({reason})") from None
        body = _decode(raw)
        if not isinstance(body, dict):
            raise BrokerUnavailable(f"{method} {path}: HTTP {status} with a body that is not a JSON object")
        return body


def _decode(raw: bytes) -> Any:
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _detail(body: Any) -> str:
    """A short reason from a DRF-style error body, never the whole page."""
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            if isinstance(body.get(key), str):
                return body[key][:200]
        return json.dumps(body)[:200]
    return ""
