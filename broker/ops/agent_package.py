"""The node agent as a tarball served by the broker itself, so a new cloud VM (or an air-gapped
on-prem node) installs exactly the agent this broker speaks to, with no package index involved."""
from __future__ import annotations

import io
import tarfile
from functools import lru_cache
from pathlib import Path

from django.conf import settings
from django.http import HttpRequest, HttpResponse

AGENT_DIR = Path(settings.BASE_DIR) / "agent"


def _include(path: Path) -> bool:
    return "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo")


@lru_cache(maxsize=1)
def agent_tarball() -> bytes:
    """`agent/` (sources + requirements.txt) as a reproducible .tar.gz: sorted, fixed times and owners."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=9) as tar:
        for path in sorted(p for p in AGENT_DIR.rglob("*") if p.is_file() and _include(p)):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(AGENT_DIR.parent)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with path.open("rb") as handle:
                tar.addfile(info, handle)
    return buffer.getvalue()


def agent_package(request: HttpRequest) -> HttpResponse:
    """GET /agent/package.tar.gz: public (the agent holds no secret); needs a join token to be useful."""
    response = HttpResponse(agent_tarball(), content_type="application/gzip")
    response["Content-Disposition"] = 'attachment; filename="whalezen-agent.tar.gz"'
    return response
