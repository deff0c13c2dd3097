"""Uploads: the tar.gz archives `whalezen submit` sends of a SkyPilot task's local workdir and
file_mounts, which jobs name as `upload:<id>` in their `files` (docs/job-spec.md, "Uploads").

- The blob lives on disk, `WHALEZEN_UPLOAD_DIR/<tenant id>/<id>.tar.gz` (the database holds only its
  row): it is streamed there in chunks, with its SHA-256 computed and the size limit
  (`WHALEZEN_MAX_UPLOAD_BYTES`) enforced while reading, so a big body never sits in memory and an
  oversized one is cut off as soon as it passes the limit.
- Before it is kept, the archive is read through once: a gzip-compressed tar whose members are
  regular files and folders only, with relative names and no '..', at most `MAX_MEMBERS` of them and
  at most `UNPACK_FACTOR` times the size limit unpacked. Anything else (links, devices, a tar bomb, a
  truncated archive) is refused, field `body`. The agent checks the same again when it unpacks
  (agent/fetch_upload.py): the broker's word is not the only guard.
- A team keeps at most `WHALEZEN_MAX_UPLOADS_PER_TENANT` uploads and
  `WHALEZEN_MAX_UPLOAD_BYTES_PER_TENANT` bytes of them. The same content sent again by the same user
  is the same upload (its clock restarts): resubmitting a task does not pile up copies.
- An upload that no unfinished job names is deleted `WHALEZEN_UPLOAD_EXPIRY_DAYS` after it was sent
  (`uploads_expire`, run by Celery beat).
- Agents download with a token (`upload_download_token`) signed with SECRET_KEY, scoped to one
  upload and one job of the upload's team, expiring after `WHALEZEN_UPLOAD_TOKEN_SECONDS`: the job's
  own process fetches its files (as the job user, who has no node token), and a token that leaks
  with the job's environment opens that one upload for a day, nothing else.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import tarfile
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import IO

from django.conf import settings
from django.core import signing
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from broker.jobs.models import Job, Upload, UploadKind
from broker.jobs.states import TERMINAL_STATES
from broker.tenancy.models import Tenant
from broker.tenancy.services import tenants_lock

logger = logging.getLogger(__name__)

UPLOAD_ID_RE = re.compile(r"^[0-9a-f]{32}$")
SHA256_RE = re.compile(r"^[0-9a-fA-F]{64}$")
CHUNK_BYTES = 1024 * 1024
MAX_MEMBERS = 20_000
UNPACK_FACTOR = 4  # an archive may unpack to at most this many times the upload size limit
PART_SUFFIX = ".part"
# A blob file without a row (its tenant deleted, a crash between rename and insert) or a partial file
# (a worker killed while streaming) older than this is removed by the expiry sweep.
STRAY_FILE_SECONDS = 3600
_TOKEN_SALT = "whalezen.uploads.download"


class UploadError(Exception):
    """A refusal the API answers with `status`, naming `field` (400) or only saying why (`detail`)."""

    def __init__(self, message: str, *, field: str = "body", status: int = 400) -> None:
        super().__init__(message)
        self.message, self.field, self.status = message, field, status


class UploadDenied(Exception):
    """A download token that is bad, expired, or for another upload (403)."""


@dataclass(frozen=True)
class ArchiveSummary:
    members: int
    unpacked_bytes: int


# -- where blobs live --------------------------------------------------------------------------------
def upload_root() -> Path:
    return Path(settings.WHALEZEN_UPLOAD_DIR)


def _tenant_dir(tenant_id: int) -> Path:
    path = upload_root() / str(int(tenant_id))
    path.mkdir(parents=True, exist_ok=True, mode=0o700)  # the broker's alone: jobs fetch over HTTP
    return path


def blob_path(upload: Upload) -> Path:
    return upload_root() / str(int(upload.tenant_id)) / f"{upload.id}.tar.gz"


def max_upload_bytes() -> int:
    return int(settings.WHALEZEN_MAX_UPLOAD_BYTES)


def max_unpacked_bytes() -> int:
    return UNPACK_FACTOR * max_upload_bytes()


# -- receiving -----------------------------------------------------------------------------------------
def _check_declared_sha256(declared: str | None) -> str | None:
    if declared is None or declared == "":
        return None
    if not SHA256_RE.match(declared):
        raise UploadError("Must be the body's SHA-256 as 64 hexadecimal digits.", field="X-Content-SHA256")
    return declared.lower()


def _stream_to(stream: IO[bytes] | None, target: Path, limit: int) -> tuple[int, str]:
    """Copy the body to `target` in chunks; (size, sha256). Refused as soon as it passes `limit`."""
    digest = hashlib.sha256()
    size = 0
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        while stream is not None:
            chunk = stream.read(CHUNK_BYTES)
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise UploadError(f"Upload is larger than {limit} bytes (WHALEZEN_MAX_UPLOAD_BYTES): leave large "
                                  "data in s3:// or gs:// and name it in file_mounts, or add what need not be "
                                  "sent to .skyignore.")
            digest.update(chunk)
            out.write(chunk)
    if size == 0:
        raise UploadError("Body is empty: send the tar.gz archive (Content-Type: application/gzip).")
    return size, digest.hexdigest()


def _member_problem(member: tarfile.TarInfo) -> str | None:
    name = member.name
    if name.startswith("/") or "\x00" in name:
        return "an absolute name"
    if ".." in PurePosixPath(name).parts:
        return "a '..' segment"
    if member.issym() or member.islnk():
        return "a link (only regular files and folders are unpacked)"
    if member.isdir():
        return None
    if not member.isreg() or member.issparse():
        return "not a regular file or folder (devices, FIFOs and sparse files are refused)"
    return None


def archive_inspect(path: Path, *, kind: str, max_unpacked: int, max_members: int | None = None) -> ArchiveSummary:
    """Read the whole archive once (every member's data too, so a truncated one is caught here, not on
    a node); raise UploadError for anything the agent would refuse to unpack."""
    max_members = MAX_MEMBERS if max_members is None else max_members
    members = 0
    unpacked = 0
    regular = 0
    try:
        with tarfile.open(path, mode="r:gz") as archive:
            while (member := archive.next()) is not None:
                members += 1
                if members > max_members:
                    raise UploadError(f"Archive holds more than {max_members} files and folders.")
                problem = _member_problem(member)
                if problem:
                    raise UploadError(f"Archive member {member.name[:200]!r} is {problem}.")
                if member.isdir():
                    continue
                regular += 1
                unpacked += member.size
                if unpacked > max_unpacked:
                    raise UploadError(f"Archive unpacks to more than {max_unpacked} bytes "
                                      f"({UNPACK_FACTOR}x the upload limit): refused as a possible tar bomb.")
                source = archive.extractfile(member)
                assert source is not None  # a regular member always has data
                while source.read(CHUNK_BYTES):
                    pass
    except UploadError:
        raise
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        reason = str(exc) or type(exc).__name__
        raise UploadError(f"Body is not a complete gzip-compressed tar archive ({reason[:160]}).") from None
    if members == 0:
        raise UploadError("Archive is empty.")
    if kind == UploadKind.FILE and (regular != 1 or members != 1):
        raise UploadError("An upload of kind=file holds exactly one regular file.")
    return ArchiveSummary(members=members, unpacked_bytes=unpacked)


def _tenant_limits_problem(tenant: Tenant, adding_bytes: int) -> str | None:
    held = Upload.objects.filter(tenant=tenant)
    count_limit = int(settings.WHALEZEN_MAX_UPLOADS_PER_TENANT)
    if held.count() + 1 > count_limit:
        return (f"This team keeps {count_limit} uploads, the most it may (WHALEZEN_MAX_UPLOADS_PER_TENANT): "
                "delete some (DELETE /api/v1/uploads/{id}/) or wait for old ones to expire.")
    bytes_limit = int(settings.WHALEZEN_MAX_UPLOAD_BYTES_PER_TENANT)
    total = held.aggregate(total=Sum("size_bytes"))["total"] or 0
    if total + adding_bytes > bytes_limit:
        return (f"This team's uploads would hold more than {bytes_limit} bytes "
                "(WHALEZEN_MAX_UPLOAD_BYTES_PER_TENANT): delete some (DELETE /api/v1/uploads/{id}/).")
    return None


def upload_receive(*, tenant: Tenant, owner, stream: IO[bytes] | None, content_length: int | None = None,
                   declared_sha256: str | None = None, kind: str = UploadKind.TREE) -> tuple[Upload, bool]:
    """Stream one archive to disk, check it, keep it. (upload, created): the same archive sent again
    by the same user is the upload it already has (created False, its expiry clock restarted)."""
    declared = _check_declared_sha256(declared_sha256)
    limit = max_upload_bytes()
    if content_length is not None and content_length > limit:
        raise UploadError(f"Upload is larger than {limit} bytes (WHALEZEN_MAX_UPLOAD_BYTES).")
    problem = _tenant_limits_problem(tenant, 0)
    if problem:
        raise UploadError(problem, field="detail", status=409)
    folder = _tenant_dir(tenant.pk)
    part = folder / f".{secrets.token_hex(8)}{PART_SUFFIX}"
    try:
        size, sha256 = _stream_to(stream, part, limit)
        if declared and declared != sha256:
            raise UploadError(f"The body was changed or cut short on the way: its SHA-256 is {sha256[:12]}..., "
                              f"not X-Content-SHA256's {declared[:12]}...; send it again.")
        summary = archive_inspect(part, kind=kind, max_unpacked=max_unpacked_bytes())
        with transaction.atomic():
            tenants_lock([tenant.pk])  # one upload of a team at a time
            existing = Upload.objects.filter(tenant=tenant, owner=owner, sha256=sha256, kind=kind).first()
            if existing is not None and blob_path(existing).is_file():
                existing.created_at = timezone.now()
                existing.save(update_fields=["created_at"])
                return existing, False
            problem = _tenant_limits_problem(tenant, size)
            if problem:
                raise UploadError(problem, field="detail", status=409)
            upload = Upload(id=secrets.token_hex(16), tenant=tenant, owner=owner, kind=kind, sha256=sha256,
                            size_bytes=size, unpacked_bytes=summary.unpacked_bytes, members=summary.members)
            os.replace(part, blob_path(upload))
            try:
                upload.save(force_insert=True)
            except BaseException:
                blob_path(upload).unlink(missing_ok=True)
                raise
        return upload, True
    finally:
        part.unlink(missing_ok=True)


# -- naming and deleting -------------------------------------------------------------------------------
def upload_check(tenant: Tenant, upload_id: str) -> str | None:
    """Why a job spec of `tenant` may not name `upload:<upload_id>`, or None when it may."""
    if not UPLOAD_ID_RE.match(upload_id or "") or not Upload.objects.filter(tenant=tenant, id=upload_id).exists():
        return (f"No upload {upload_id[:40]!r} in this team: upload the folder with `whalezen submit` (or POST "
                f"/api/v1/uploads/); uploads no unfinished job names are deleted after "
                f"{float(settings.WHALEZEN_UPLOAD_EXPIRY_DAYS):g} days.")
    return None


def _unfinished_jobs_naming(uploads: Iterable[Upload]) -> dict[str, int]:
    """{upload id: id of an unfinished job naming it} among `uploads` (of one or more teams)."""
    wanted = {u.id: u.tenant_id for u in uploads}
    if not wanted:
        return {}
    found: dict[str, int] = {}
    jobs = (Job.objects.filter(tenant_id__in=set(wanted.values())).exclude(state__in=TERMINAL_STATES)
            .values_list("id", "tenant_id", "spec"))
    for job_id, tenant_id, spec in jobs.iterator():
        for entry in (spec or {}).get("files") or []:
            source = entry.get("source", "") if isinstance(entry, dict) else ""
            upload_id = source[len("upload:"):] if source.startswith("upload:") else ""
            if wanted.get(upload_id) == tenant_id:
                found.setdefault(upload_id, job_id)
    return found


def upload_delete(*, upload: Upload) -> None:
    """Delete an upload (409 while an unfinished job names it: its nodes still fetch it)."""
    job_id = _unfinished_jobs_naming([upload]).get(upload.id)
    if job_id is not None:
        raise UploadError(f"Job {job_id} has not finished and names this upload; cancel it first or wait.",
                          field="detail", status=409)
    _delete(upload)


def _delete(upload: Upload) -> None:
    path = blob_path(upload)
    upload.delete()
    path.unlink(missing_ok=True)


def upload_expires_at(upload: Upload):
    return upload.created_at + timedelta(days=settings.WHALEZEN_UPLOAD_EXPIRY_DAYS)


def uploads_expire(*, now=None) -> int:
    """Delete uploads older than the expiry that no unfinished job names, and stray files; how many
    uploads went."""
    now = now or timezone.now()
    old = list(Upload.objects.filter(created_at__lt=now - timedelta(days=settings.WHALEZEN_UPLOAD_EXPIRY_DAYS)))
    named = _unfinished_jobs_naming(old)
    deleted = 0
    for upload in old:
        if upload.id not in named:
            _delete(upload)
            deleted += 1
    _remove_stray_files(time.time())
    if deleted:
        logger.info("deleted %d expired uploads", deleted)
    return deleted


def _remove_stray_files(now_s: float) -> None:
    root = upload_root()
    if not root.is_dir():
        return
    for folder in root.iterdir():
        if not folder.is_dir() or not folder.name.isdigit():
            continue
        kept = set(Upload.objects.filter(tenant_id=int(folder.name)).values_list("id", flat=True))
        for path in folder.iterdir():
            stem = path.name[:-len(".tar.gz")] if path.name.endswith(".tar.gz") else None
            if stem in kept:
                continue
            try:
                if now_s - path.lstat().st_mtime > STRAY_FILE_SECONDS:
                    path.unlink()
            except OSError:  # gone meanwhile, or not ours to remove: the next sweep tries again
                pass


# -- agent downloads -----------------------------------------------------------------------------------
def upload_download_token(upload_id: str, job_id: int) -> str:
    """A credential that downloads upload `upload_id` for job `job_id` (broker/agents/selectors.py puts
    it into the job's assignment), valid WHALEZEN_UPLOAD_TOKEN_SECONDS."""
    return signing.TimestampSigner(salt=_TOKEN_SALT).sign(f"{upload_id}.{int(job_id)}")


def upload_for_download(upload_id: str, token: str) -> Upload:
    """The upload a token opens. UploadDenied for a bad, expired or other upload's token, or a job of
    another team; Upload.DoesNotExist when the token is good but the upload is gone."""
    try:
        value = signing.TimestampSigner(salt=_TOKEN_SALT).unsign(token, max_age=settings.WHALEZEN_UPLOAD_TOKEN_SECONDS)
    except signing.SignatureExpired:
        raise UploadDenied("The download token has expired.") from None
    except signing.BadSignature:
        raise UploadDenied("The download token is not valid.") from None
    token_upload, _, job_id = value.partition(".")
    if token_upload != upload_id or not job_id.isdigit():
        raise UploadDenied("The download token is for another upload.")
    upload = Upload.objects.get(id=upload_id)
    if not Job.objects.filter(pk=int(job_id), tenant_id=upload.tenant_id).exists():
        raise UploadDenied("The download token is for a job of another team.")
    return upload
