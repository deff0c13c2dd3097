"""`gs://bucket/object` and `gs://bucket/prefix/` onto the node, through the GCS JSON API over urllib.

Why not google-cloud-storage: it would add about ten packages (api-core, protobuf, requests,
resumable-media, crc32c...) to every GPU node for a listing and a few GETs; the agent stays small
(docs/agent.md, "Job files"). What it would have given, this does: the same endpoint override
(STORAGE_EMULATOR_HOST, which the official clients and fake-gcs-server use) and the usual
credentials, tried in this order:

1. GOOGLE_OAUTH_ACCESS_TOKEN (an access token, as gcloud and Terraform accept it);
2. Application Default Credentials through google-auth, where it is installed (a service-account
   key in GOOGLE_APPLICATION_CREDENTIALS, gcloud's user login, the GCE metadata server);
3. the GCE metadata server directly (a GPU VM's service account), GCE_METADATA_HOST to override;
4. none: anonymous, which is what a public bucket needs.

Against an emulator only the first applies (emulators take no credentials).
"""
from __future__ import annotations

import json
import os
import posixpath
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from agent.fetch_dest import FetchError, Fetched, atomic_file, make_dirs, tree_path

PUBLIC_ENDPOINT = "https://storage.googleapis.com"
METADATA_TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"
READ_ONLY_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
METADATA_TIMEOUT_S = 2.0  # the metadata server answers in milliseconds on GCE; elsewhere it is absent
HTTP_TIMEOUT_S = 60.0  # per socket operation, not per download
CHUNK = 1 << 20


def fetch_gs(source: str, destination: Path, home: Path) -> Fetched:
    bucket, _, name = source[len("gs://"):].partition("/")
    if not bucket:
        raise FetchError("no bucket named")
    api = _Api(bucket)
    if name and not name.endswith("/"):
        item = api.object(name)
        if item is not None:
            target = destination / posixpath.basename(name) if destination.is_dir() else destination
            api.download(name, target, home)
            return Fetched(files=1, bytes=int(item.get("size", 0)))
        found = _tree(api, name + "/", destination, home)
        if found is None:
            raise FetchError(f"no object {name!r} in bucket {bucket!r}, and nothing under {name + '/'!r}")
        return found
    found = _tree(api, name, destination, home)
    if found is None:
        raise FetchError(f"nothing under {name!r} in bucket {bucket!r}" if name else f"bucket {bucket!r} is empty")
    return found


def _tree(api: "_Api", prefix: str, destination: Path, home: Path) -> Fetched | None:
    files = size = 0
    seen = False
    for item in api.listing(prefix):
        seen = True
        relative = item["name"][len(prefix):]
        if not relative or relative.endswith("/"):  # a console-made "folder"
            make_dirs(destination / relative.strip("/") if relative.strip("/") else destination, home)
            continue
        api.download(item["name"], tree_path(destination, relative, home), home)
        files += 1
        size += int(item.get("size", 0))
    if not seen:
        return None
    make_dirs(destination, home)
    return Fetched(files=files, bytes=size)


class _Api:
    def __init__(self, bucket: str) -> None:
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
        if emulator and "://" not in emulator:
            emulator = "http://" + emulator
        self.endpoint = (emulator or PUBLIC_ENDPOINT).rstrip("/")
        self.bucket = bucket
        self.token = _token(emulator=bool(emulator))

    def _url(self, name: str | None = None, **query: str) -> str:
        path = f"/storage/v1/b/{urllib.parse.quote(self.bucket, safe='')}/o"
        if name is not None:
            path += "/" + urllib.parse.quote(name, safe="")
        return self.endpoint + path + ("?" + urllib.parse.urlencode(query) if query else "")

    def _open(self, url: str) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=HTTP_TIMEOUT_S)
        except urllib.error.HTTPError as err:
            raise _HttpError(err.code, _message(err), anonymous=not self.token) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise FetchError(f"cannot reach {self.endpoint}: {reason}") from None

    def object(self, name: str) -> dict[str, Any] | None:
        """The object's metadata, or None when there is no such object (the bucket exists)."""
        try:
            with self._open(self._url(name)) as response:
                return json.load(response)
        except _HttpError as err:
            if err.status == 404 and "bucket does not exist" not in err.message.lower():
                return None
            raise FetchError(str(err)) from None

    def listing(self, prefix: str) -> Any:
        token = ""
        while True:
            query = {"prefix": prefix, "fields": "items(name,size),nextPageToken"}
            if token:
                query["pageToken"] = token
            try:
                with self._open(self._url(**query)) as response:
                    page = json.load(response)
            except _HttpError as err:
                raise FetchError(str(err)) from None
            yield from page.get("items", [])
            token = page.get("nextPageToken") or ""
            if not token:
                return

    def download(self, name: str, target: Path, home: Path) -> None:
        with atomic_file(target, home) as tmp:
            try:
                with self._open(self._url(name, alt="media")) as response, open(tmp, "wb") as out:
                    shutil.copyfileobj(response, out, CHUNK)
            except _HttpError as err:
                raise FetchError(f"{name}: {err}") from None
            except OSError as err:  # the connection broke in the middle of the body
                raise FetchError(f"{name}: download interrupted: {err}") from None


class _HttpError(Exception):
    def __init__(self, status: int, message: str, *, anonymous: bool) -> None:
        self.status, self.message, self.anonymous = status, message, anonymous
        hint = ""
        if status in (401, 403):
            hint = ("; no Google credentials were found (GOOGLE_OAUTH_ACCESS_TOKEN, GOOGLE_APPLICATION_CREDENTIALS "
                    "with google-auth installed, or a GCE service account)" if anonymous else "")
        super().__init__(f"HTTP {status}: {message}{hint}")


def _message(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read() or b"{}")
        return str(body.get("error", {}).get("message") or err.reason)
    except (ValueError, AttributeError, OSError):
        return str(err.reason)


def _token(*, emulator: bool) -> str | None:
    explicit = os.environ.get("GOOGLE_OAUTH_ACCESS_TOKEN", "").strip()
    if explicit or emulator:
        return explicit or None
    return _adc_token() or _metadata_token()


def _adc_token() -> str | None:
    try:
        import google.auth
        import google.auth.transport.requests
    except ImportError:
        return None
    try:
        credentials, _ = google.auth.default(scopes=[READ_ONLY_SCOPE])
        credentials.refresh(google.auth.transport.requests.Request())
    except Exception:  # noqa: BLE001 - any failure here means "no ADC": try the metadata server, then none
        return None
    return getattr(credentials, "token", None) or None


def _metadata_token() -> str | None:
    host = os.environ.get("GCE_METADATA_HOST", "metadata.google.internal")
    request = urllib.request.Request(f"http://{host}{METADATA_TOKEN_PATH}", headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=METADATA_TIMEOUT_S) as response:
            return json.load(response).get("access_token") or None
    except (OSError, ValueError):
        return None
