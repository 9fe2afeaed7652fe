"""A worker's local copy of an uploaded .blend (and its zip's files), checked by sha256."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from farm.errors import (
    StorageCorrupt,
    StorageNotFound,
)
from farm.models import BlendSource
from farm.storage.base import Storage, check_key, sha256_file
from farm.storage.layout import ZIP_FILES
from farm.storage.local import LocalStorage


def cached_upload(storage: Storage, source: BlendSource, cache_dir: Path) -> Path:
    """A local file with an uploaded .blend: the stored file where the store is a folder, else
    a copy in ``cache_dir`` by sha256 (downloaded once per host, checked against its hash)."""
    if isinstance(storage, LocalStorage):
        return storage.fetch(source.location, cache_dir)
    if ZIP_FILES in source.location:
        return _cached_file_set(storage, source, cache_dir)
    path = cache_dir / source.sha256 / Path(source.name).name
    if path.is_file():
        return path
    storage.get(source.location, path)
    if sha256_file(path) != source.sha256:
        path.unlink(missing_ok=True)
        raise StorageCorrupt(
            f"{storage.url_for(source.location)} does not hash to {source.sha256}",
            key=source.location,
        )
    return path


def _cached_file_set(storage: Storage, source: BlendSource, cache_dir: Path) -> Path:
    """A zip upload's .blend with every file beside it (textures, libraries): relative paths
    like ``//textures/wood.png`` resolve. Each file is checked against its stored sha256; the
    set appears in the cache whole (renamed into place) or not at all."""
    prefix = source.location[: source.location.index(ZIP_FILES) + len(ZIP_FILES)]
    blend_rel = source.location[len(prefix) :]
    folder = cache_dir / source.sha256 / "files"
    if not (folder / blend_rel).is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=".files-", dir=folder.parent))
        try:
            for obj in storage.list(prefix):
                storage.get(obj.key, partial / check_key(obj.key[len(prefix) :]))
            try:
                os.rename(partial, folder)
            except OSError:
                if not (folder / blend_rel).is_file():  # not another worker's complete copy
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    path = folder / blend_rel
    if not path.is_file():
        raise StorageNotFound(
            f"{storage.url_for(source.location)} does not exist", key=source.location
        )
    return path
