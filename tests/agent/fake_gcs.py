"""A tiny Google Cloud Storage JSON API on loopback, for agent/fetch_gs.py (no GCS emulator here).

It serves what the fetch uses, as GCS answers it: object listing by prefix with pagination
(`nextPageToken`), one object's metadata, and its bytes with `?alt=media`; 404 with GCS's own
messages for a missing bucket or object; 401 when a token is required and missing.
"""
from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeGcs:
    def __init__(self, *, page_size: int = 2, token: str | None = None) -> None:
        self.buckets: dict[str, dict[str, bytes]] = {}
        self.page_size = page_size
        self.token = token
        self.requests: list[tuple[str, str | None]] = []  # (path with query, Authorization header)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                fake.requests.append((self.path, self.headers.get("Authorization")))
                status, body, kind = fake.answer(self.path, self.headers.get("Authorization"))
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path: str, authorization: str | None) -> tuple[int, bytes, str]:
        if self.token is not None and authorization != f"Bearer {self.token}":
            return _error(401, "Anonymous caller does not have storage.objects.get access.")
        url = urllib.parse.urlsplit(path)
        query = dict(urllib.parse.parse_qsl(url.query))
        parts = url.path.split("/")  # ['', 'storage', 'v1', 'b', BUCKET, 'o', (NAME)]
        if parts[1:4] != ["storage", "v1", "b"] or len(parts) < 6 or parts[5] != "o":
            return _error(404, "Not Found")
        bucket = self.buckets.get(urllib.parse.unquote(parts[4]))
        if bucket is None:
            return _error(404, "The specified bucket does not exist.")
        if len(parts) == 6:
            names = sorted(n for n in bucket if n.startswith(query.get("prefix", "")))
            start = int(query.get("pageToken") or 0)
            page = names[start:start + self.page_size]
            listing: dict[str, object] = {"kind": "storage#objects"}
            if page:
                listing["items"] = [{"name": n, "size": str(len(bucket[n]))} for n in page]
            if start + self.page_size < len(names):
                listing["nextPageToken"] = str(start + self.page_size)
            return 200, json.dumps(listing).encode(), "application/json"
        name = urllib.parse.unquote("/".join(parts[6:]))
        if name not in bucket:
            return _error(404, f"No such object: {parts[4]}/{name}")
        if query.get("alt") == "media":
            return 200, bucket[name], "application/octet-stream"
        return 200, json.dumps({"name": name, "size": str(len(bucket[name]))}).encode(), "application/json"


def _error(status: int, message: str) -> tuple[int, bytes, str]:
    return status, json.dumps({"error": {"code": status, "message": message}}).encode(), "application/json"
