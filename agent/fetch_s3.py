"""`s3://bucket/key` and `s3://bucket/prefix/` onto the node, through boto3.

One object is one file; a source ending in `/`, or a name with no object of its own but objects
under `name/`, is copied as a tree. Credentials come from boto3's usual chain as the job process
sees it: AWS_* variables (the agent's, handed to jobs, or the job's own env and secrets), an
instance role through the metadata service, a web identity; with none at all the request goes
unsigned, which is what a public bucket needs. AWS_ENDPOINT_URL (boto3 reads it) points the client
at another S3 (MinIO, moto in the tests). boto3 follows a bucket's region by itself.
"""
from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

from agent.fetch_dest import FetchError, Fetched, atomic_file, make_dirs, tree_path


def fetch_s3(source: str, destination: Path, home: Path) -> Fetched:
    bucket, _, key = source[len("s3://"):].partition("/")
    if not bucket:
        raise FetchError("no bucket named")
    try:
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
    except ImportError as err:
        raise FetchError(f"cannot import boto3 ({err}): install agent/requirements.txt for the agent's "
                         "Python") from None
    client = _client(boto3)
    try:
        try:
            return _fetch(client, bucket, key, destination, home)
        except NoCredentialsError:
            from botocore import UNSIGNED
            from botocore.config import Config

            # No credentials anywhere: try as anonymous, which is enough for a public bucket.
            return _fetch(_client(boto3, Config(signature_version=UNSIGNED)), bucket, key, destination, home)
    except ClientError as err:
        raise FetchError(_client_error(err)) from None
    except BotoCoreError as err:
        raise FetchError(str(err)) from None


def _client(boto3: Any, config: Any = None) -> Any:
    return boto3.session.Session().client("s3", config=config)


def _fetch(client: Any, bucket: str, key: str, destination: Path, home: Path) -> Fetched:
    from botocore.exceptions import ClientError

    if key and not key.endswith("/"):
        try:
            size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
        except ClientError as err:
            if _status(err) not in (403, 404):  # 403: no s3:GetObject on a key that may not exist
                raise
            found = _tree(client, bucket, key + "/", destination, home)
            if found is None:
                if _status(err) == 403:
                    raise
                raise FetchError(f"no object {key!r} in bucket {bucket!r}, and nothing under {key + '/'!r}") from None
            return found
        target = destination / posixpath.basename(key) if destination.is_dir() else destination
        with atomic_file(target, home) as tmp:
            client.download_file(bucket, key, tmp)
        return Fetched(files=1, bytes=size)
    found = _tree(client, bucket, key, destination, home)
    if found is None:
        raise FetchError(f"nothing under {key!r} in bucket {bucket!r}" if key else f"bucket {bucket!r} is empty")
    return found


def _tree(client: Any, bucket: str, prefix: str, destination: Path, home: Path) -> Fetched | None:
    """Every object under `prefix`, or None when there is none."""
    files = size = 0
    seen = False
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            seen = True
            relative = item["Key"][len(prefix):]
            if not relative or relative.endswith("/"):  # a console-made "folder": nothing to copy
                make_dirs(destination / relative.strip("/") if relative.strip("/") else destination, home)
                continue
            target = tree_path(destination, relative, home)
            with atomic_file(target, home) as tmp:
                client.download_file(bucket, item["Key"], tmp)
            files += 1
            size += int(item.get("Size", 0))
    if not seen:
        return None
    make_dirs(destination, home)  # a tree of folder markers only is still a folder
    return Fetched(files=files, bytes=size)


def _status(err: Any) -> int:
    return int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _client_error(err: Any) -> str:
    error = err.response.get("Error", {})
    code, message = error.get("Code", ""), error.get("Message", "")
    status = _status(err)
    if code in ("NoSuchBucket",):
        return f"no such bucket ({code})"
    if status == 403 or code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return (f"access denied ({code or status}{': ' + message if message else ''}); the job process uses the "
                "node's AWS credentials (instance role, AWS_* env) or the job's own AWS_* env")
    return f"{code or status}: {message or err}"
