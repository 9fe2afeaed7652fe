"""Which store a URL names: a folder (``file://`` or a plain path) or S3 (``s3://``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from farm.errors import (
    BadParameter,
)

if TYPE_CHECKING:
    from farm.settings import Settings
from farm.storage.base import Storage
from farm.storage.local import LocalStorage


def parse_url(url: str) -> tuple[str, str, str]:
    """``(scheme, where, prefix)`` of a storage URL: ``("s3", bucket, prefix)`` or
    ``("file", folder, "")``; a plain path is a folder. Refuses anything else."""
    parts = urlsplit(url)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise BadParameter(f"storage URL {url!r} names no bucket: s3://BUCKET/PREFIX")
        return "s3", parts.netloc, parts.path.strip("/")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise BadParameter(f"storage URL {url!r}: file:// URLs name a local path")
        return "file", parts.path, ""
    if parts.scheme == "":
        return "file", url, ""
    raise BadParameter(f"storage URL {url!r} is not file:///PATH or s3://BUCKET/PREFIX", url=url)


def open_storage(url: str, settings: Settings) -> Storage:
    """The store at ``url``: ``file:///path``, a plain path, or ``s3://bucket[/prefix]``."""
    scheme, where, prefix = parse_url(url)
    if scheme == "s3":
        from farm.storage.s3 import S3Storage

        return S3Storage(where, prefix, settings)
    return LocalStorage(Path(where))


def farm_storage(settings: Settings) -> Storage:
    """The farm's own store (uploads, tiles): FARM_STORAGE_URL, else the FARM_STORAGE_DIR folder."""
    return open_storage(settings.storage_url or str(settings.storage_dir), settings)


def is_url(output: str) -> bool:
    """Whether an output names a store by URL (``s3://``, ``file://``) rather than a folder."""
    return "://" in output
