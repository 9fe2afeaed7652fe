"""The local-folder store, storage URLs and storage settings (no S3 needed)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from farm.delivery import output_address
from farm.errors import AlreadyCommitted, BadParameter, StorageError, StorageNotFound
from farm.settings import Settings
from farm.storage.base import FILE_MODE
from farm.storage.factory import farm_storage, open_storage
from farm.storage.local import LocalStorage


def test_storage_urls_choose_the_store(tmp_path: Path) -> None:
    settings = Settings()
    local = open_storage(f"file://{tmp_path}/store", settings)
    assert isinstance(local, LocalStorage) and local.root == tmp_path / "store"
    plain = open_storage(str(tmp_path / "plain"), settings)
    assert isinstance(plain, LocalStorage) and plain.root == tmp_path / "plain"
    for bad in ("s3://", "ftp://host/x", "file://otherhost/x"):
        with pytest.raises(BadParameter):
            open_storage(bad, settings)


def test_the_farm_store_is_the_storage_dir_unless_a_url_is_set(tmp_path: Path) -> None:
    default = farm_storage(Settings().with_(storage_dir=tmp_path / "s"))
    assert isinstance(default, LocalStorage) and default.root == tmp_path / "s"
    chosen = farm_storage(
        Settings().with_(storage_dir=tmp_path / "s", storage_url=f"file://{tmp_path}/u")
    )
    assert isinstance(chosen, LocalStorage) and chosen.root == tmp_path / "u"


def test_outputs_keep_store_urls_and_resolve_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert output_address("s3://bucket/renders/shot1/") == "s3://bucket/renders/shot1"
    assert output_address("render/x") == str(tmp_path / "render" / "x")
    with pytest.raises(BadParameter, match="names no bucket"):
        output_address("s3:///renders")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FARM_S3_SSE": "rot13"}, "FARM_S3_SSE"),
        ({"FARM_S3_CHECKSUM": "always"}, "FARM_S3_CHECKSUM"),
        ({"FARM_S3_ADDRESSING_STYLE": "dns"}, "FARM_S3_ADDRESSING_STYLE"),
        ({"FARM_TILE_RETENTION": "forever"}, "FARM_TILE_RETENTION"),
        ({"FARM_PRESIGN_EXPIRY_S": str(8 * 86400)}, "7 days"),
        ({"FARM_S3_MULTIPART_CHUNK_MIB": "4"}, "at least 5"),
    ],
)
def test_bad_storage_settings_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(BadParameter, match=message):
        Settings.from_env(env)


def test_storage_settings_are_read_from_the_environment() -> None:
    settings = Settings.from_env(
        {
            "FARM_STORAGE_URL": "s3://frames/farm",
            "FARM_S3_ENDPOINT_URL": "http://minio:9000",
            "FARM_S3_SSE": "aws:kms",
            "FARM_S3_KMS_KEY_ID": "alias/tessera",
            "FARM_S3_STORAGE_CLASS": "GLACIER_IR",
            "FARM_S3_CHECKSUM": "when_required",
            "FARM_PRESIGN_EXPIRY_S": "3600",
        }
    )
    assert (settings.storage_url, settings.s3_endpoint_url) == (
        "s3://frames/farm",
        "http://minio:9000",
    )
    assert (settings.s3_sse, settings.s3_kms_key_id) == ("aws:kms", "alias/tessera")
    assert settings.s3_storage_class == "GLACIER_IR" and settings.presign_expiry_s == 3600
    assert Settings.from_env(settings.to_env()) == settings


def test_a_key_cannot_leave_the_folder(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "s")
    src = tmp_path / "x"
    src.write_bytes(b"x")
    for key in ("../escape", "/etc/passwd", "a//b", "a/./b"):
        with pytest.raises(StorageError):
            store.put(key, src)
    assert not (tmp_path / "escape").exists()


def test_commit_once_in_a_folder_keeps_the_first_bytes(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "s")
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"first")
    b.write_bytes(b"second")
    store.put("out/frame_0001.png", a, once=True)
    store.put("out/frame_0001.png", a, once=True)  # the same bytes: a retried commit
    with pytest.raises(AlreadyCommitted):
        store.put("out/frame_0001.png", b, once=True)
    assert store.read_bytes("out/frame_0001.png") == b"first"
    store.put("out/frame_0001.png", b)  # a plain put replaces
    assert store.read_bytes("out/frame_0001.png") == b"second"
    assert [p.name for p in (tmp_path / "s" / "out").iterdir()] == ["frame_0001.png"]


def test_bytes_are_put_whole_in_place_and_leave_nothing_beside(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "s")
    assert store.put_bytes("jobs/j/logs/1/0-a1.log", b"first\n").size == 6
    stored = store.put_bytes("jobs/j/logs/1/0-a1.log", b"second\n")  # replaces, whole
    assert stored.size == 7 and store.read_bytes("jobs/j/logs/1/0-a1.log") == b"second\n"
    folder = tmp_path / "s" / "jobs/j/logs/1"
    assert [p.name for p in folder.iterdir()] == ["0-a1.log"], "a temporary file stayed"
    assert oct((folder / "0-a1.log").stat().st_mode & 0o777) == oct(FILE_MODE)
    # a folder where the object goes: refused, and nothing half-written stays beside it
    (folder / "taken").mkdir()
    with pytest.raises(StorageError):
        store.put_bytes("jobs/j/logs/1/taken", b"x")
    assert sorted(p.name for p in folder.iterdir()) == ["0-a1.log", "taken"]
    with pytest.raises(StorageError):
        store.put_bytes("../escape", b"x")
    assert not (tmp_path / "escape").exists()


def test_uploads_tiles_listing_and_removal(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "s")
    blend = tmp_path / "scene.blend"
    blend.write_bytes(b"BLENDER" * 100)
    source = store.put_upload(blend)
    sha = hashlib.sha256(blend.read_bytes()).hexdigest()
    assert source.location == f"uploads/{sha}/scene.blend" and source.sha256 == sha
    assert store.put_upload(blend) == source
    for i in range(2):
        tile = tmp_path / f"t{i}.exr"
        tile.write_bytes(b"t" * (i + 1))
        store.move_in(f"jobs/j/tiles/1/{i}-a0.exr", tile)
        assert not tile.exists(), "a tile's scratch file is moved, not copied"
    assert [(o.key, o.size) for o in store.list("jobs/j/tiles/1/")] == [
        ("jobs/j/tiles/1/0-a0.exr", 1),
        ("jobs/j/tiles/1/1-a0.exr", 2),
    ]
    assert store.fetch("jobs/j/tiles/1/0-a0.exr", tmp_path / "unused") == (
        tmp_path / "s" / "jobs/j/tiles/1/0-a0.exr"
    )
    assert store.delete_prefix("jobs/j/tiles/1") == 2
    assert store.list("jobs/") == [] and store.exists(source.location)
    assert store.presign(source.location, 60) == (tmp_path / "s" / source.location).as_uri()
    with pytest.raises(StorageNotFound):
        store.get("jobs/j/tiles/1/0-a0.exr", tmp_path / "gone")
    # a job's output folder before its first frame lists nothing (never its parent folder)
    assert LocalStorage(tmp_path / "s" / "not-yet").list("") == []
