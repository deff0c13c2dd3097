"""Where checkpoints live: a local directory or an S3 prefix, behind one small contract.

Paths handed to a Storage are relative to its root ("step-000000000042/model.pt") and have already
passed manifest.check_name; the storages still refuse anything that would resolve outside the root,
because a check in one place is too easy to lose in a refactor.

boto3 is imported only when an `s3://` URI is opened, so jobs that checkpoint to a local or
network-mounted path need nothing but the standard library.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from agent.checkpoint.manifest import Hasher

CHUNK = 1024 * 1024
_TMP_PREFIX = ".wz-tmp-"  # half-written files; never listed in a manifest, so never read as data


class Storage(Protocol):
    uri: str

    def list_dirs(self) -> list[str]:
        """Names of the directories (S3: common prefixes) directly under the root."""

    def read_bytes(self, rel: str) -> bytes:
        """The whole object; FileNotFoundError if there is none."""

    def iter_chunks(self, rel: str) -> Iterator[bytes]:
        """The object in chunks, for hashing without holding it in memory; FileNotFoundError if none."""

    def put(self, rel: str, source: bytes | Path) -> tuple[int, str]:
        """Write `source` at `rel` whole or not at all, and return the size and sha256 written."""

    def exists(self, rel: str) -> bool: ...

    def remove(self, rel: str) -> None:
        """Delete one file if it is there."""

    def commit_dir(self, dir_rel: str) -> None:
        """Make the directory's entries durable (local: fsync the directory; S3: nothing to do)."""

    def delete_dir(self, dir_rel: str) -> None:
        """Remove a checkpoint directory and everything under it."""

    def uri_of(self, rel: str) -> str: ...

    def local_path(self, rel: str) -> Path | None:
        """The file itself when the storage is a local directory, else None (it must be downloaded)."""


def open_storage(uri: str, *, s3_client: Any = None) -> Storage:
    """`s3://bucket/prefix`, `file:///abs/path` or `/abs/path`; anything else is refused."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError("no checkpoint URI (set WHALEZEN_CHECKPOINT_URI or pass uri=)")
    uri = uri.strip()
    if uri.startswith("s3://"):
        parts = urlsplit(uri)
        if not parts.netloc:
            raise ValueError(f"checkpoint URI {uri!r} names no bucket")
        return S3Storage(parts.netloc, parts.path.strip("/"), client=s3_client)
    if uri.startswith("file://"):
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"checkpoint URI {uri!r} names a remote host; mount it and use a path")
        path = unquote(parts.path)
    elif "://" in uri:
        raise ValueError(f"checkpoint URI {uri!r}: only s3://, file:// and absolute paths are supported")
    else:
        path = uri
    if not os.path.isabs(path):
        raise ValueError(f"checkpoint path {path!r} is not absolute")
    return LocalStorage(Path(path))


class LocalStorage:
    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.normpath(root))
        self.uri = str(self.root)

    def _path(self, rel: str) -> Path:
        path = Path(os.path.normpath(self.root / rel))
        if path == self.root or self.root not in path.parents:
            raise ValueError(f"{rel!r} is not inside {self.root}")
        return path

    def list_dirs(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []

    def read_bytes(self, rel: str) -> bytes:
        return b"".join(self.iter_chunks(rel))

    def iter_chunks(self, rel: str) -> Iterator[bytes]:
        # O_NOFOLLOW on the file: the broker verifies checkpoints a job wrote, and a link planted as
        # "model.pt -> /etc/shadow" must not make it hash (and so reveal the size of) that file.
        path = self._path(rel)
        root_real, parent_real = self.root.resolve(), path.parent.resolve()
        if parent_real != root_real and root_real not in parent_real.parents:
            raise FileNotFoundError(f"{rel}: its folder leads outside the checkpoint directory")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as err:
            if err.errno == 40:  # ELOOP: the name is a symbolic link
                raise FileNotFoundError(f"{rel}: is a symbolic link, not a file") from None
            raise
        with os.fdopen(fd, "rb") as handle:
            while chunk := handle.read(CHUNK):
                yield chunk

    def put(self, rel: str, source: bytes | Path) -> tuple[int, str]:
        final = self._path(rel)
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=_TMP_PREFIX)
        hasher = Hasher()
        try:
            with os.fdopen(fd, "wb") as out:
                # Hash what is written, not what was meant: a file that changes under us while it
                # is copied gets the digest of the bytes that actually landed.
                for chunk in _chunks_of(source):
                    out.write(chunk)
                    hasher.update(chunk)
                out.flush()
                os.fsync(out.fileno())  # data on disk before the name can point at it
            os.chmod(tmp, 0o644)
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(final.parent)
        return hasher.size, hasher.hexdigest

    def exists(self, rel: str) -> bool:
        return self._path(rel).is_file()

    def remove(self, rel: str) -> None:
        path = self._path(rel)
        path.unlink(missing_ok=True)
        if path.parent.is_dir():
            _fsync_dir(path.parent)

    def commit_dir(self, dir_rel: str) -> None:
        path = self._path(dir_rel)
        for folder, subdirs, _ in os.walk(path):
            for sub in subdirs:
                _fsync_dir(Path(folder) / sub)
        _fsync_dir(path)
        _fsync_dir(self.root)

    def delete_dir(self, dir_rel: str) -> None:
        shutil.rmtree(self._path(dir_rel))

    def uri_of(self, rel: str) -> str:
        return str(self._path(rel))

    def local_path(self, rel: str) -> Path | None:
        return self._path(rel)


class S3Storage:
    def __init__(self, bucket: str, prefix: str, *, client: Any = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                import boto3
            except ImportError:
                raise ImportError(
                    "s3:// checkpoints need boto3 (pip install boto3); local paths need nothing"
                ) from None
            # The endpoint comes from AWS_ENDPOINT_URL(_S3) when set, credentials from the usual chain.
            self._client = boto3.client("s3")
        return self._client

    def _key(self, rel: str) -> str:
        if any(seg in ("", ".", "..") for seg in rel.split("/")):
            raise ValueError(f"{rel!r} is not a plain relative name")
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def list_dirs(self) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        names = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                names.append(common["Prefix"][len(base):].rstrip("/"))
        return sorted(names)

    def read_bytes(self, rel: str) -> bytes:
        return b"".join(self.iter_chunks(rel))

    def iter_chunks(self, rel: str) -> Iterator[bytes]:
        client = self.client
        try:
            body = client.get_object(Bucket=self.bucket, Key=self._key(rel))["Body"]
        except client.exceptions.NoSuchKey:
            raise FileNotFoundError(self.uri_of(rel)) from None
        try:
            while chunk := body.read(CHUNK):
                yield chunk
        finally:
            body.close()

    def put(self, rel: str, source: bytes | Path) -> tuple[int, str]:
        # An S3 PUT is atomic per object: readers see the old object, none, or the whole new one.
        hasher = Hasher()
        for chunk in _chunks_of(source):
            hasher.update(chunk)
        if isinstance(source, bytes):
            self.client.put_object(Bucket=self.bucket, Key=self._key(rel), Body=source)
        else:
            # upload_file goes multipart for big files; the digest above is of the file as it was
            # read, and verify() re-reads the uploaded object before anyone trusts it.
            self.client.upload_file(str(source), self.bucket, self._key(rel))
        return hasher.size, hasher.hexdigest

    def exists(self, rel: str) -> bool:
        client = self.client
        try:
            client.head_object(Bucket=self.bucket, Key=self._key(rel))
        except client.exceptions.ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def remove(self, rel: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(rel))

    def commit_dir(self, dir_rel: str) -> None:
        return None  # every PUT is durable once it returns

    def delete_dir(self, dir_rel: str) -> None:
        base = self._key(dir_rel) + "/"
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})

    def uri_of(self, rel: str) -> str:
        return f"s3://{self.bucket}/{self._key(rel)}"

    def local_path(self, rel: str) -> Path | None:
        return None


def _chunks_of(source: bytes | Path) -> Iterator[bytes]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        for start in range(0, len(data), CHUNK):
            yield data[start:start + CHUNK]
        return
    with open(source, "rb") as handle:
        while chunk := handle.read(CHUNK):
            yield chunk


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Whole or nothing at `path`, never through a link left at that name (temp + fsync + rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
