"""tar.gz archives as `whalezen submit` packs a workdir (tests of the uploads API, the agent's fetch and
the SkyPilot workdir), and hostile members to put in them."""
from __future__ import annotations

import io
import tarfile
from typing import Callable


def archive(files: dict[str, bytes] | None = None, *,
            extra: Callable[[tarfile.TarFile], None] | None = None) -> bytes:
    """A tar.gz of `files` (name -> content; `.sh` files executable); `extra(tar)` may add hostile members."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in (files or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o755 if name.endswith(".sh") else 0o644
            tar.addfile(info, io.BytesIO(content))
        if extra:
            extra(tar)
    return buffer.getvalue()


def member(tar: tarfile.TarFile, name: str, type_: bytes, *, linkname: str = "", content: bytes = b"") -> None:
    """Add one member of any type (a link, a device, a path that climbs out); only a regular file has a size."""
    info = tarfile.TarInfo(name)
    info.type = type_
    info.linkname = linkname
    info.size = len(content) if type_ == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(content) if content else None)
