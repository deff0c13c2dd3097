"""agent/fetch_upload.py: an upload is downloaded with the job's token and unpacked inside its
destination only; hostile archives and broken downloads are refused with a reason."""
from __future__ import annotations

import hashlib
import os
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent import fetch_upload as fu
from agent.fetch_upload import UploadFetchError, fetch_upload, unpack
from tests.tarballs import archive, member

UPLOAD_ID = "0123456789abcdef" * 2
SOURCE = f"upload:{UPLOAD_ID}"


class FakeBroker:
    """Answers GET /api/v1/agent/uploads/<id> with queued (status, body, headers) replies."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, bytes, dict[str, str]]] = []
        self.requests: list[tuple[str, str]] = []  # (path, Authorization)
        broker = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                broker.requests.append((self.path, self.headers.get("Authorization", "")))
                status, body, headers = broker.replies.pop(0) if broker.replies else (500, b"", {})
                self.send_response(status)
                headers = {"Content-Length": str(len(body)), **headers}
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def blob(self, body: bytes, *, kind: str = "tree", sha: str | None = None, unpacked: int | None = None) -> None:
        headers = {"Content-Type": "application/gzip", "X-Content-SHA256": sha or hashlib.sha256(body).hexdigest(),
                   "X-WhaleZen-Upload-Kind": kind}
        if unpacked is not None:
            headers["X-WhaleZen-Unpacked-Bytes"] = str(unpacked)
        self.replies.append((200, body, headers))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def broker():
    fake = FakeBroker()
    yield fake
    fake.close()


def fetch(broker: FakeBroker, destination: Path, **kwargs) -> None:
    fetch_upload(broker.url, SOURCE, destination, "tok-1", sleep=lambda s: None, **kwargs)


def test_a_folder_upload_is_unpacked_into_its_destination(broker, tmp_path):
    broker.blob(archive({"train.py": b"print(1)\n", "data/a.txt": b"a", "run.sh": b"#!/bin/sh\n"}))
    destination = tmp_path / "home" / "sky_workdir"
    assert fetch_upload(broker.url, SOURCE, destination, "tok-1") == (3, 20)  # files, bytes
    assert (destination / "train.py").read_bytes() == b"print(1)\n"
    assert (destination / "data" / "a.txt").read_bytes() == b"a"
    assert os.access(destination / "run.sh", os.X_OK)
    assert broker.requests == [(f"/api/v1/agent/uploads/{UPLOAD_ID}", "Upload tok-1")]
    assert sorted(p.name for p in destination.parent.iterdir()) == ["sky_workdir"]  # no scratch left


def test_a_file_upload_is_written_at_the_destination(broker, tmp_path):
    broker.blob(archive({"config.yaml": b"lr: 0.1\n"}), kind="file")
    destination = tmp_path / "home" / "conf" / "train.yaml"
    fetch(broker, destination)
    assert destination.read_bytes() == b"lr: 0.1\n"


def test_a_refused_token_or_missing_upload_is_not_retried(broker, tmp_path):
    broker.replies = [(403, b"{}", {}), (200, b"", {})]
    with pytest.raises(UploadFetchError, match="refused the download token"):
        fetch(broker, tmp_path / "d")
    assert len(broker.requests) == 1
    broker.replies = [(404, b"{}", {})]
    with pytest.raises(UploadFetchError, match="no such upload"):
        fetch(broker, tmp_path / "d")


def test_a_busy_broker_and_a_damaged_download_are_retried(broker, tmp_path):
    body = archive({"a.py": b"1"})
    broker.replies.append((503, b"", {}))
    broker.blob(body, sha="0" * 64)  # changed on the way
    broker.blob(body)
    fetch(broker, tmp_path / "d")
    assert (tmp_path / "d" / "a.py").read_bytes() == b"1" and len(broker.requests) == 3
    broker.replies = [(503, b"", {})] * 3
    with pytest.raises(UploadFetchError, match="HTTP 503 .gave up after 3 tries"):
        fetch(broker, tmp_path / "e", attempts=3)


def test_a_redirect_is_not_followed_with_the_token(broker, tmp_path):
    elsewhere = FakeBroker()
    try:
        broker.replies.append((302, b"", {"Location": f"{elsewhere.url}/steal"}))
        with pytest.raises(UploadFetchError, match="HTTP 302"):
            fetch(broker, tmp_path / "d")
        assert elsewhere.requests == []
    finally:
        elsewhere.close()


HOSTILE = {
    "dotdot": lambda t: member(t, "../escape.txt", tarfile.REGTYPE, content=b"x"),
    "inner-dotdot": lambda t: member(t, "a/../../escape.txt", tarfile.REGTYPE, content=b"x"),
    "absolute": lambda t: member(t, "/tmp/escape.txt", tarfile.REGTYPE, content=b"x"),
    "symlink": lambda t: member(t, "link", tarfile.SYMTYPE, linkname="../outside"),
    "hardlink": lambda t: member(t, "hard", tarfile.LNKTYPE, linkname="/etc/passwd"),
    "device": lambda t: member(t, "dev", tarfile.CHRTYPE),
    "fifo": lambda t: member(t, "fifo", tarfile.FIFOTYPE),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_archives_write_nothing(tmp_path, name):
    path = tmp_path / "a.tar.gz"
    path.write_bytes(archive({"ok.txt": b"fine"}, extra=HOSTILE[name]))
    destination = tmp_path / "home" / "work"
    with pytest.raises(UploadFetchError):
        unpack(path, destination)
    assert not (tmp_path / "home" / "escape.txt").exists() and not (tmp_path / "escape.txt").exists()
    assert not destination.exists() or list(destination.iterdir()) == []  # checked before anything is written


def test_an_existing_symlink_cannot_lead_outside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    destination = tmp_path / "work"
    destination.mkdir()
    (destination / "data").symlink_to(outside)
    path = tmp_path / "a.tar.gz"
    path.write_bytes(archive({"data/evil.txt": b"x"}))
    with pytest.raises(UploadFetchError, match="outside the destination"):
        unpack(path, destination)
    assert list(outside.iterdir()) == []


def test_a_tar_bomb_and_too_many_members_are_refused(tmp_path, monkeypatch):
    path = tmp_path / "bomb.tar.gz"
    path.write_bytes(archive({"zeros": bytes(1024 * 1024)}))
    with pytest.raises(UploadFetchError, match="unpacks to more than"):
        unpack(path, tmp_path / "d", max_unpacked=100_000)
    monkeypatch.setattr(fu, "MAX_MEMBERS", 3)
    path.write_bytes(archive({f"f{i}": b"" for i in range(4)}))
    with pytest.raises(UploadFetchError, match="more than 3 entries"):
        unpack(path, tmp_path / "e")


def test_the_brokers_declared_size_caps_unpacking(broker, tmp_path):
    broker.blob(archive({"zeros": bytes(200_000)}), unpacked=1000)
    with pytest.raises(UploadFetchError, match="unpacks to more than 1000 bytes"):
        fetch(broker, tmp_path / "d")


def test_a_damaged_archive_is_said_so(tmp_path):
    path = tmp_path / "a.tar.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(UploadFetchError, match="damaged"):
        unpack(path, tmp_path / "d")
    with pytest.raises(UploadFetchError, match="not an upload"):
        fetch_upload("http://127.0.0.1:9", "upload:../../x", tmp_path / "d", "t")
