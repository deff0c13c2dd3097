"""Uploads (broker/jobs/uploads.py, /api/v1/uploads/, /api/v1/agent/uploads/<id>): streamed to disk
with their limits, hostile archives refused by field `body`, another team's uploads unknown, agent
downloads only with the job's token, and old unused uploads expired."""
from __future__ import annotations

import hashlib
import os
import tarfile
import time
from datetime import timedelta

import pytest
from django.core import signing
from django.utils import timezone
from rest_framework.test import APIClient

from broker.jobs import uploads
from broker.jobs.models import Job, Upload
from broker.jobs.states import JobState
from broker.jobs.tasks import expire_uploads
from tests.tarballs import archive, member

URL = "/api/v1/uploads/"


def post(client: APIClient, body: bytes, *, kind: str | None = None, **headers):
    query = f"?kind={kind}" if kind else ""
    return client.post(URL + query, data=body, content_type=headers.pop("content_type", "application/gzip"),
                       **headers)


@pytest.fixture(autouse=True)
def upload_dir(settings, tmp_path):
    settings.WHALEZEN_UPLOAD_DIR = tmp_path / "uploads"
    return settings.WHALEZEN_UPLOAD_DIR


def blobs(root) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file())


def test_a_member_uploads_an_archive_streamed_to_disk(acme, upload_dir):
    body = archive({"train.py": b"print('hi')\n", "data/a.txt": b"a" * 10})
    response = post(acme.member_client, body)
    assert response.status_code == 201, response.json()
    data = response.json()
    assert len(data["id"]) == 32 and data["sha256"] == hashlib.sha256(body).hexdigest()
    assert data["size_bytes"] == len(body) and data["kind"] == "tree" and data["members"] == 2
    stored = upload_dir / str(acme.tenant.pk) / f"{data['id']}.tar.gz"
    assert stored.read_bytes() == body
    listed = acme.viewer_client.get(URL).json()["results"]
    assert [u["id"] for u in listed] == [data["id"]]
    # The same archive again from the same user is the same upload.
    again = post(acme.member_client, body)
    assert again.status_code == 200 and again.json()["id"] == data["id"]
    assert Upload.objects.count() == 1


def test_a_viewer_cannot_upload(acme):
    assert post(acme.viewer_client, archive({"a": b"1"})).status_code == 403


def test_the_json_body_limit_does_not_apply_to_uploads_only(acme, settings):
    assert settings.WHALEZEN_MAX_BODY_BYTES == 256 * 1024
    big = archive({"weights.bin": os.urandom(600 * 1024)})  # random: does not compress
    assert len(big) > settings.WHALEZEN_MAX_BODY_BYTES
    assert post(acme.member_client, big).status_code == 201
    padded = '{"name": "x", "pad": "' + "a" * (300 * 1024) + '"}'
    refused = acme.member_client.post("/api/v1/jobs/", data=padded, content_type="application/json")
    assert refused.status_code == 400 and "body" in refused.json()


def test_an_upload_over_the_limit_is_refused_and_nothing_kept(acme, settings, upload_dir):
    settings.WHALEZEN_MAX_UPLOAD_BYTES = 100 * 1024
    response = post(acme.member_client, archive({"big.bin": os.urandom(200 * 1024)}))
    assert response.status_code == 400
    assert "larger than 102400 bytes" in response.json()["body"][0]
    assert Upload.objects.count() == 0 and blobs(upload_dir) == []


class CountingStream:
    """A body of `size` bytes with no Content-Length, counting what the server read of it."""

    def __init__(self, size: int) -> None:
        self.left, self.read_bytes = size, 0

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        self.left -= n
        self.read_bytes += n
        return b"\x1f" * n


def test_the_limit_is_enforced_while_reading(acme, settings, upload_dir):
    settings.WHALEZEN_MAX_UPLOAD_BYTES = 3 * uploads.CHUNK_BYTES
    stream = CountingStream(50 * uploads.CHUNK_BYTES)
    with pytest.raises(uploads.UploadError, match="larger than"):
        uploads.upload_receive(tenant=acme.tenant, owner=acme.member, stream=stream, content_length=None)
    assert stream.read_bytes <= 4 * uploads.CHUNK_BYTES  # stopped just past the limit, not at the end
    assert blobs(upload_dir) == []


def test_a_declared_content_length_over_the_limit_is_refused_before_reading(acme, settings):
    settings.WHALEZEN_MAX_UPLOAD_BYTES = 1024
    stream = CountingStream(10)
    with pytest.raises(uploads.UploadError):
        uploads.upload_receive(tenant=acme.tenant, owner=acme.member, stream=stream, content_length=5000)
    assert stream.read_bytes == 0


def test_a_tar_bomb_is_refused(acme, settings):
    settings.WHALEZEN_MAX_UPLOAD_BYTES = 64 * 1024
    bomb = archive({"zeros": bytes(1024 * 1024)})  # 1 MiB of zeros packs to about 1 KB
    assert len(bomb) < 64 * 1024
    response = post(acme.member_client, bomb)
    assert response.status_code == 400
    assert "tar bomb" in response.json()["body"][0]


def test_too_many_members_are_refused(acme, monkeypatch):
    monkeypatch.setattr(uploads, "MAX_MEMBERS", 5)
    response = post(acme.member_client, archive({f"f{i}": b"" for i in range(6)}))
    assert response.status_code == 400 and "more than 5 files" in response.json()["body"][0]


@pytest.mark.parametrize("extra, said", [
    (lambda t: member(t, "../escape.sh", tarfile.REGTYPE, content=b"x"), "'..'"),
    (lambda t: member(t, "a/../../escape.sh", tarfile.REGTYPE, content=b"x"), "'..'"),
    (lambda t: member(t, "/etc/cron.d/x", tarfile.REGTYPE, content=b"x"), "absolute"),
    (lambda t: member(t, "link", tarfile.SYMTYPE, linkname="/etc/passwd"), "link"),
    (lambda t: member(t, "hard", tarfile.LNKTYPE, linkname="code.py"), "link"),
    (lambda t: member(t, "dev", tarfile.CHRTYPE), "not a regular file"),
    (lambda t: member(t, "fifo", tarfile.FIFOTYPE), "not a regular file"),
], ids=["dotdot", "inner-dotdot", "absolute", "symlink", "hardlink", "device", "fifo"])
def test_hostile_members_are_refused_by_field_body(acme, extra, said, upload_dir):
    response = post(acme.member_client, archive({"code.py": b"1"}, extra=extra))
    assert response.status_code == 400, response.json()
    assert said in response.json()["body"][0]
    assert Upload.objects.count() == 0 and blobs(upload_dir) == []


def test_what_is_not_a_whole_tar_gz_is_refused(acme):
    body = archive({"a.bin": os.urandom(50_000)})
    for bad in (b"just text, not gzip", body[: len(body) // 2], b""):
        response = post(acme.member_client, bad)
        assert response.status_code == 400 and "body" in response.json(), bad[:20]
    for wrong_type in ("application/json", "text/plain"):
        assert post(acme.member_client, body, content_type=wrong_type).status_code == 415


def test_a_kind_file_upload_holds_exactly_one_file(acme):
    assert post(acme.member_client, archive({"config.yaml": b"a: 1\n"}), kind="file").status_code == 201
    two = post(acme.member_client, archive({"a": b"1", "b": b"2"}), kind="file")
    assert two.status_code == 400 and "exactly one regular file" in two.json()["body"][0]
    assert post(acme.member_client, archive({"a": b"1"}), kind="folder").status_code == 400


def test_the_declared_sha256_is_checked(acme):
    body = archive({"a": b"1"})
    wrong = post(acme.member_client, body, HTTP_X_CONTENT_SHA256="0" * 64)
    assert wrong.status_code == 400 and "changed or cut short" in wrong.json()["body"][0]
    malformed = post(acme.member_client, body, HTTP_X_CONTENT_SHA256="abc")
    assert malformed.status_code == 400 and "X-Content-SHA256" in malformed.json()
    right = post(acme.member_client, body, HTTP_X_CONTENT_SHA256=hashlib.sha256(body).hexdigest().upper())
    assert right.status_code == 201


def test_a_team_keeps_a_bounded_number_of_uploads_and_bytes(acme, settings):
    settings.WHALEZEN_MAX_UPLOADS_PER_TENANT = 1
    assert post(acme.member_client, archive({"a": b"1"})).status_code == 201
    second = post(acme.member_client, archive({"b": b"2"}))
    assert second.status_code == 409 and "WHALEZEN_MAX_UPLOADS_PER_TENANT" in second.json()["detail"]
    settings.WHALEZEN_MAX_UPLOADS_PER_TENANT = 10
    settings.WHALEZEN_MAX_UPLOAD_BYTES_PER_TENANT = Upload.objects.get().size_bytes + 10
    third = post(acme.member_client, archive({"c": os.urandom(100)}))
    assert third.status_code == 409 and "WHALEZEN_MAX_UPLOAD_BYTES_PER_TENANT" in third.json()["detail"]


def _upload(world, files=None, client=None) -> str:
    response = post(client or world.member_client, archive(files or {"train.py": b"print(1)\n"}))
    assert response.status_code in (200, 201), response.json()
    return response.json()["id"]


def test_another_teams_upload_is_not_found_anywhere(acme, globex):
    upload_id = _upload(acme)
    assert globex.client.get(f"{URL}{upload_id}/").status_code == 404
    assert globex.client.delete(f"{URL}{upload_id}/").status_code == 404
    assert globex.client.get(URL).json()["results"] == []
    assert acme.client.get(f"{URL}{upload_id}/").status_code == 200
    assert uploads.upload_check(globex.tenant, upload_id) is not None
    assert uploads.upload_check(acme.tenant, upload_id) is None
    assert uploads.upload_check(acme.tenant, "../../etc") is not None
    assert Upload.objects.filter(id=upload_id).exists()


def test_a_job_spec_naming_another_teams_upload_is_refused(acme, globex):
    upload_id = _upload(acme)
    spec = {"name": "train", "command": ["python", "train.py"], "resources": {"gpus": 1},
            "files": [{"source": f"upload:{upload_id}", "destination": "~/code"}]}
    refused = globex.client.post("/api/v1/jobs/", data=spec, format="json")
    assert refused.status_code == 400, refused.json()
    assert "No upload" in str(refused.json())
    assert acme.client.post("/api/v1/jobs/", data=spec, format="json").status_code == 201


def test_members_delete_their_own_uploads_not_while_a_job_needs_them(acme, upload_dir):
    mine = _upload(acme)
    admins = _upload(acme, {"other.py": b"2"}, client=acme.client)
    assert acme.member_client.delete(f"{URL}{admins}/").status_code == 403
    job = Job.objects.create(tenant=acme.tenant, owner=acme.member, name="t", state=JobState.RUNNING,
                             spec={"files": [{"source": f"upload:{mine}", "destination": "~/code"}]})
    busy = acme.member_client.delete(f"{URL}{mine}/")
    assert busy.status_code == 409 and f"Job {job.pk}" in busy.json()["detail"]
    Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED)
    assert acme.member_client.delete(f"{URL}{mine}/").status_code == 204
    assert not Upload.objects.filter(id=mine).exists()
    assert blobs(upload_dir) == [f"{admins}.tar.gz"]
    assert acme.client.delete(f"{URL}{admins}/").status_code == 204  # an admin may delete any


# -- agent downloads -----------------------------------------------------------------------------------
def _job(world, upload_id: str) -> Job:
    return Job.objects.create(tenant=world.tenant, owner=world.member, name="t", state=JobState.STARTING,
                              spec={"files": [{"source": f"upload:{upload_id}", "destination": "~/code"}]})


def download(upload_id: str, token: str | None):
    client = APIClient()
    if token is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Upload {token}")
    return client.get(f"/api/v1/agent/uploads/{upload_id}")


def test_the_jobs_token_downloads_its_upload(acme):
    body = archive({"train.py": b"print(1)\n"})
    upload_id = post(acme.member_client, body).json()["id"]
    token = uploads.upload_download_token(upload_id, _job(acme, upload_id).pk)
    response = download(upload_id, token)
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == body
    assert response["X-Content-SHA256"] == hashlib.sha256(body).hexdigest()
    assert response["Content-Length"] == str(len(body)) and response["X-WhaleZen-Upload-Kind"] == "tree"


def test_download_tokens_are_scoped_and_expire(acme, globex, monkeypatch):
    upload_id = _upload(acme)
    other_id = _upload(acme, {"b.py": b"2"})
    job = _job(acme, upload_id)
    assert download(upload_id, uploads.upload_download_token(other_id, job.pk)).status_code == 403
    assert download(upload_id, None).status_code == 403
    assert download(upload_id, "garbage").status_code == 403
    forged = uploads.upload_download_token(upload_id, job.pk)[:-2] + "xx"
    assert download(upload_id, forged).status_code == 403
    # A job of another team cannot name it, so no token of its job opens it.
    globex_job = Job.objects.create(tenant=globex.tenant, owner=globex.member, name="g", spec={})
    assert download(upload_id, uploads.upload_download_token(upload_id, globex_job.pk)).status_code == 403
    real_time = time.time
    monkeypatch.setattr(signing.time, "time", lambda: real_time() - 25 * 3600)
    old = uploads.upload_download_token(upload_id, job.pk)
    monkeypatch.setattr(signing.time, "time", real_time)
    expired = download(upload_id, old)
    assert expired.status_code == 403 and "expired" in expired.json()["detail"]
    assert download(upload_id, uploads.upload_download_token(upload_id, job.pk)).status_code == 200


def test_an_unknown_upload_is_404_and_a_bad_id_is_no_route(acme):
    missing = "f" * 32
    job = Job.objects.create(tenant=acme.tenant, owner=acme.member, name="t", spec={})
    assert download(missing, uploads.upload_download_token(missing, job.pk)).status_code == 404
    assert download(missing, "garbage").status_code == 403  # a bad token learns nothing
    assert APIClient().get("/api/v1/agent/uploads/..%2F..%2Fetc").status_code == 404


# -- expiry --------------------------------------------------------------------------------------------
def test_old_uploads_no_unfinished_job_names_are_expired(acme, globex, upload_dir, settings):
    assert settings.CELERY_BEAT_SCHEDULE["uploads-expire"]["task"] == "uploads.expire"
    old_unused, old_pending, old_done, fresh = (_upload(acme, {f"{n}.py": n.encode()}) for n in "abcd")
    globex_old = _upload(globex, {"a.py": b"a"})  # globex's job names acme's id: it keeps nothing alive
    week_ago = timezone.now() - timedelta(days=8)
    Upload.objects.exclude(id=fresh).update(created_at=week_ago)
    Job.objects.create(tenant=acme.tenant, owner=acme.member, name="p", state=JobState.PENDING,
                       spec={"files": [{"source": f"upload:{old_pending}", "destination": "~/c"}]})
    Job.objects.create(tenant=acme.tenant, owner=acme.member, name="d", state=JobState.FAILED,
                       spec={"files": [{"source": f"upload:{old_done}", "destination": "~/c"}]})
    Job.objects.create(tenant=globex.tenant, owner=globex.member, name="g", state=JobState.RUNNING,
                       spec={"files": [{"source": f"upload:{old_unused}", "destination": "~/c"}]})
    stray = upload_dir / str(acme.tenant.pk) / ".deadbeef.part"
    stray.write_bytes(b"partial")
    os.utime(stray, (time.time() - 2 * 3600,) * 2)
    expire_uploads()
    assert set(Upload.objects.values_list("id", flat=True)) == {old_pending, fresh}
    assert blobs(upload_dir) == sorted([f"{old_pending}.tar.gz", f"{fresh}.tar.gz"])
    assert not Upload.objects.filter(id=globex_old).exists()


def test_sending_an_old_upload_again_restarts_its_clock(acme):
    body = archive({"a.py": b"1"})
    upload_id = post(acme.member_client, body).json()["id"]
    Upload.objects.filter(id=upload_id).update(created_at=timezone.now() - timedelta(days=8))
    assert post(acme.member_client, body).json()["id"] == upload_id
    expire_uploads()
    assert Upload.objects.filter(id=upload_id).exists()


def test_an_agent_fetches_and_unpacks_an_upload_from_the_live_broker(live_server, acme, tmp_path):
    """The whole path over real HTTP: the CLI's kind of archive in, agent/fetch_upload.py out."""
    from agent.fetch_upload import UploadFetchError, fetch_upload

    upload_id = _upload(acme, {"train.py": b"print(1)\n", "lib/m.py": b"X = 1\n"})
    job = _job(acme, upload_id)
    destination = tmp_path / "home" / "sky_workdir"
    fetch_upload(live_server.url, f"upload:{upload_id}", destination,
                 uploads.upload_download_token(upload_id, job.pk))
    assert (destination / "train.py").read_bytes() == b"print(1)\n"
    assert (destination / "lib" / "m.py").read_bytes() == b"X = 1\n"
    other = _upload(acme, {"other.py": b"2"})
    with pytest.raises(UploadFetchError, match="HTTP 403"):
        fetch_upload(live_server.url, f"upload:{other}", tmp_path / "x", uploads.upload_download_token(upload_id, job.pk),
                     sleep=lambda s: None)
