"""A full disk costs time, not an attempt: ENOSPC is a transient storage fault, waited out with
back-off until the disk has room (issue #14 item 1). The disk is a real 1 MiB tmpfs."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from farm.errors import StorageUnavailable
from farm.models import BlendSource, JobSpec
from farm.settings import Settings
from farm.storage.base import StoredObject
from farm.storage.local import LocalStorage
from tests.farmprocs import until
from workers.stillmodes import preview_key
from workers.storageretry import retry_storage
from workers.tasks import WorkerContext, _keep_preview


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def test_a_full_disk_is_transient_and_a_store_waits_until_it_has_room(
    disk: Path, tmp_path: Path
) -> None:
    storage = LocalStorage(disk / "store")
    tile = tmp_path / "tile.exr"
    tile.write_bytes(os.urandom(200_000))
    filler = _fill(disk)
    with pytest.raises(StorageUnavailable) as info:
        storage.put("jobs/j/tiles/1/0-a1.exr", tile)
    assert "No space left" in info.value.message
    assert not [p for p in (disk / "store").rglob("*") if p.is_file()], "a partial file stayed"

    kept: list[int] = []
    result: list[StoredObject] = []
    worker = threading.Thread(target=lambda: result.append(retry_storage(
        lambda: storage.move_in("jobs/j/tiles/1/0-a1.exr", tile), budget_s=60,
        what="tile 0 of frame 1", keep=lambda: kept.append(1))))  # fmt: skip
    expected = tile.read_bytes()
    worker.start()
    until(lambda: len(kept) >= 2, 20, "two retries on the full disk")
    filler.unlink()  # the disk has room again
    worker.join(30)
    assert result and result[0].size == len(expected)
    assert (disk / "store/jobs/j/tiles/1/0-a1.exr").read_bytes() == expected
    assert not tile.exists(), "the scratch file is moved in once stored"


def test_a_disk_full_past_the_budget_fails_saying_for_how_long(disk: Path, tmp_path: Path) -> None:
    storage = LocalStorage(disk / "store")
    frame = tmp_path / "frame_0001.png"
    frame.write_bytes(os.urandom(200_000))
    _fill(disk)
    with pytest.raises(StorageUnavailable) as info:
        retry_storage(lambda: storage.put("frame_0001.png", frame), budget_s=1.0,
                      what="frame 1", keep=lambda: None)  # fmt: skip
    assert "frame 1: the storage kept failing for 1 s" in info.value.message
    assert frame.exists(), "the frame is kept for the next try"


def test_an_animations_preview_waits_out_a_full_disk_and_its_mp4_is_made(
    disk: Path, tmp_path: Path
) -> None:
    """The assembler keeps each frame's preview still in the farm's storage: a full disk there
    (the chaos run saw one fail a job at frame 2's assembly) is waited out like a tile's."""
    storage = LocalStorage(disk / "store")
    spec = JobSpec(BlendSource("path", "/nowhere/a.blend", "0" * 64, "a.blend"), (1, 2), "1x1",
                   32, 16, str(tmp_path / "out"), formats=("png",))  # fmt: skip
    stills = []
    for frame, value in ((1, 40), (2, 200)):
        still = tmp_path / f"still-{frame}.png"
        Image.new("RGB", (32, 16), (value, value, value)).save(still)
        stills.append(still)
    work = tmp_path / "work"
    work.mkdir()
    ctx = WorkerContext(settings=Settings(storage_retry_s=60), name="w", conn=None,  # type: ignore[arg-type]
                        store=None, queue=None, storage=storage, child=None,  # type: ignore[arg-type]
                        allocator=None, device=None)  # type: ignore[arg-type]  # fmt: skip
    assert _keep_preview(ctx, spec, "j", 1, stills[0], work, keep=lambda: None) is None
    filler = _fill(disk)
    kept: list[int] = []
    result: list[Path | None] = []

    def assemble() -> None:
        keep = lambda: kept.append(1)  # noqa: E731
        result.append(_keep_preview(ctx, spec, "j", 2, stills[1], work, keep=keep))

    worker = threading.Thread(target=assemble)
    worker.start()
    until(lambda: len(kept) >= 2, 20, "two retries on the full disk")
    assert not result, "the preview went on without its still"
    filler.unlink()
    worker.join(30)
    assert result and result[0] is not None and result[0].stat().st_size > 0
    assert storage.exists(preview_key("j", 2))
