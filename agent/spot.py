"""Spot interruption notices from the cloud's instance metadata service (`--spot-notice`).

A spot/preemptible instance is told shortly before the cloud takes it back: AWS about two minutes
ahead (`/latest/meta-data/spot/instance-action`, IMDSv2), GCP about 30 s (`.../instance/preempted`
says TRUE). The broker can use that time to ask for checkpoints and place the jobs elsewhere, so
the agent passes the notice on in every heartbeat from then on and sends one at once.

Polling runs on a thread of its own: a metadata service that hangs must never delay heartbeats or
job supervision, and the loop only reads `notice`. Each request has a 1 s timeout; errors are
logged once (until a poll succeeds again) and retried at the next poll. A notice, once seen, is
kept: the instance is going away, and a later answer cannot make that untrue.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger(__name__)

SOURCES = ("none", "aws", "gcp", "local")
DEFAULT_METADATA_URLS = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal"}
POLL_SECONDS = 5.0
TIMEOUT_SECONDS = 1.0
GCP_NOTICE_SECONDS = 30.0  # GCP gives no time: preemption comes about 30 s after the flag
AWS_TOKEN_TTL_SECONDS = 21600
AWS_ACTIONS = ("terminate", "stop", "hibernate")
_MAX_BODY = 4096


class MetadataError(RuntimeError):
    """The metadata service could not be asked, or answered something unexpected."""


@dataclass(frozen=True)
class Interruption:
    action: str  # terminate | stop | hibernate
    deadline: float  # Unix seconds when the cloud takes the instance
    source: str  # aws | gcp | local
    kind: str = "spot"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "action": self.action, "deadline": self.deadline, "source": self.source}


def metadata_url_for(source: str, url: str | None) -> str:
    """The metadata base URL for `source`; ValueError (a usage error) when none can be had."""
    if source not in SOURCES or source == "none":
        raise ValueError(f"--spot-notice {source!r}: expected one of {', '.join(SOURCES[1:])}")
    if url:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--metadata-url must start with http:// or https://, got {url[:80]!r}")
        return url.rstrip("/")
    if source == "local":
        raise ValueError("--spot-notice local needs --metadata-url")
    return DEFAULT_METADATA_URLS[source]


class SpotWatcher:
    def __init__(
        self,
        source: str,
        url: str | None = None,
        *,
        poll_s: float = POLL_SECONDS,
        timeout_s: float = TIMEOUT_SECONDS,
        wall: Callable[[], float] = time.time,
        on_notice: Callable[[Interruption], None] | None = None,
    ) -> None:
        self.source = source
        self.url = metadata_url_for(source, url)
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self._wall = wall
        self._on_notice = on_notice
        # Never through a proxy: the metadata service is link-local, and HTTP_PROXY in the agent's
        # environment (set for reaching the broker) would send these requests somewhere else.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._token: str | None = None
        self._token_until = 0.0
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.notice: Interruption | None = None

    # -- the thread --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            log.info("watching for spot interruption notices (%s, %s, every %gs)", self.source, self.url, self.poll_s)
            self._thread = threading.Thread(target=self._run, name="spot-notice", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.timeout_s + 1)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set() and self.notice is None:
            self.check_once()
            self._stop.wait(self.poll_s)

    # -- one poll ----------------------------------------------------------------------------
    def check_once(self) -> Interruption | None:
        """Ask the metadata service once; return the notice (new or kept), or None."""
        if self.notice is not None:
            return self.notice
        try:
            found = self._ask_gcp() if self.source == "gcp" else self._ask_aws()
        except MetadataError as err:
            if not self._failing:
                log.warning("spot notice: %s (retrying every %gs; logged once until it works again)", err,
                            self.poll_s)
            self._failing = True
            return None
        if self._failing:
            log.info("spot notice: the metadata service at %s answers again", self.url)
        self._failing = False
        if found is not None:
            self.notice = found
            log.warning("spot interruption notice (%s): %s at %s (in %.0fs)", found.source, found.action,
                        datetime.fromtimestamp(found.deadline).isoformat(timespec="seconds"),
                        found.deadline - self._wall())
            if self._on_notice is not None:
                self._on_notice(found)
        return found

    def _ask_aws(self) -> Interruption | None:
        """IMDSv2 (also the `local` provider's endpoint): a session token, then instance-action."""
        token = self._aws_token()
        status, body = self._request("GET", "/latest/meta-data/spot/instance-action",
                                     {"X-aws-ec2-metadata-token": token})
        if status == 401:  # the token expired or the service restarted: a fresh one next time
            self._token = None
            raise MetadataError("the metadata service refused its session token (401)")
        if status == 404:
            return None
        if status != 200:
            raise MetadataError(f"spot/instance-action answered HTTP {status}")
        try:
            data = json.loads(body)
            action = data["action"]
            deadline = _parse_time(data["time"])
        except (ValueError, KeyError, TypeError) as err:
            raise MetadataError(f"spot/instance-action answered something unexpected ({err})") from None
        if action not in AWS_ACTIONS:
            raise MetadataError(f"spot/instance-action names an unknown action {str(action)[:40]!r}")
        return Interruption(action=action, deadline=deadline, source=self.source)

    def _aws_token(self) -> str:
        if self._token is not None and self._wall() < self._token_until:
            return self._token
        status, body = self._request("PUT", "/latest/api/token",
                                     {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_SECONDS)})
        if status != 200 or not body.strip():
            raise MetadataError(f"the metadata token request answered HTTP {status}")
        self._token = body.decode("ascii", errors="replace").strip()
        self._token_until = self._wall() + AWS_TOKEN_TTL_SECONDS - 60  # renewed a minute before it lapses
        return self._token

    def _ask_gcp(self) -> Interruption | None:
        status, body = self._request("GET", "/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
        if status != 200:
            raise MetadataError(f"instance/preempted answered HTTP {status}")
        if body.strip().upper() != b"TRUE":
            return None
        return Interruption(action="terminate", deadline=self._wall() + GCP_NOTICE_SECONDS, source="gcp")

    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        request = urllib.request.Request(self.url + path, method=method, headers=headers,
                                         data=b"" if method == "PUT" else None)
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                return response.status, response.read(_MAX_BODY)
        except urllib.error.HTTPError as err:
            with err:
                return err.code, b""
        except (urllib.error.URLError, OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            raise MetadataError(f"cannot reach the metadata service at {self.url}: {reason}") from None


def _parse_time(text: Any) -> float:
    """AWS's `2026-12-01T12:00:00Z` as Unix seconds."""
    if not isinstance(text, str):
        raise ValueError("time is not a string")
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:  # AWS always says Z; a bare time is read as UTC too, never as local time
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


__all__ = ["DEFAULT_METADATA_URLS", "Interruption", "MetadataError", "POLL_SECONDS", "SOURCES", "SpotWatcher",
           "metadata_url_for"]
