"""Uploads: multipart and raw, stored once by sha256, resumable, zips, and every bad input."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import stat
import time
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from farm import jobstore
from farm.settings import Settings
from tests.conftest import TESTDATA
from tests.web.conftest import Tokens, api, bearer

PLAIN = TESTDATA / "01_principled_material.blend"
ZSTD = Path(__file__).resolve().parents[2] / "farm" / "examples" / "example.blend"
PNG = TESTDATA / "01_principled_baseColor.png"


def _zip(entries: list[tuple[str | zipfile.ZipInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries:
            zf.writestr(name, data)
    return buf.getvalue()


def _link_entry(name: str, target: str) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info, target.encode()


async def _put(
    client: TestClient[Any, Any], token: str, name: str, data: Any, project: str = "A"
) -> aiohttp.ClientResponse:
    return await client.put(
        f"/api/uploads/{name}?project={project}", data=data, headers=bearer(token)
    )


def _leftovers(settings: Settings) -> list[str]:
    """Files an upload may have left: in storage, in scratch space; and upload records."""
    files = [
        str(p)
        for root in (settings.storage_dir, settings.work_dir)
        if root.exists()
        for p in root.rglob("*")
        if p.is_file()
    ]
    conn = jobstore.connect(settings.redis_url)
    try:
        records = [str(k) for k in conn.keys("tessera:*upload*")]
    finally:
        conn.close()
    return files + records


async def test_same_bytes_uploaded_twice_are_stored_once(
    web_settings: Settings, tokens: Tokens
) -> None:
    data = PLAIN.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    async with api(web_settings) as client:
        form = aiohttp.FormData()
        form.add_field("project", "A")
        form.add_field("file", data, filename="scene.blend")
        first = await client.post("/api/uploads", data=form, headers=bearer(tokens.alice))
        assert first.status == 201, await first.text()
        rec = await first.json()
        assert (rec["upload_id"], rec["kind"], rec["size"]) == (sha, "blend", len(data))
        second = await _put(client, tokens.alice, "again.blend", data)
        assert second.status == 201
        assert (await second.json())["upload_id"] == sha
        listed = await (
            await client.get("/api/uploads?project=A", headers=bearer(tokens.alice))
        ).json()
        assert [u["upload_id"] for u in listed["uploads"]] == [sha]
    stored = [p for p in (web_settings.storage_dir / "uploads").rglob("*") if p.is_file()]
    assert len(stored) == 1
    assert stored[0].read_bytes() == data
    assert not [p for p in web_settings.work_dir.rglob("*") if p.is_file()]


async def test_gzip_and_zstd_blends_are_recognised_by_their_header(
    web_settings: Settings, tokens: Tokens
) -> None:
    async with api(web_settings) as client:
        gz = await _put(client, tokens.alice, "scene.bin", gzip.compress(PLAIN.read_bytes()))
        assert gz.status == 201, await gz.text()
        zs = await _put(client, tokens.alice, "example.blend", ZSTD.read_bytes())
        assert zs.status == 201, await zs.text()
        assert (await zs.json())["kind"] == "blend"


async def test_a_zip_with_textures_unpacks_with_its_paths(
    web_settings: Settings, tokens: Tokens
) -> None:
    data = _zip(
        [
            ("project/scene.blend", PLAIN.read_bytes()),
            ("project/textures/wood.png", PNG.read_bytes()),
            ("project/libs/lib.blend", PLAIN.read_bytes()),
        ]
    )
    async with api(web_settings) as client:
        resp = await client.post(
            "/api/uploads?project=A",
            data=data,
            headers={**bearer(tokens.alice), "X-Filename": "project.zip"},
        )
        assert resp.status == 201, await resp.text()
        rec = await resp.json()
    assert rec["kind"] == "zip"
    assert rec["blend"] == "project/scene.blend"
    assert rec["files"] == [
        "project/libs/lib.blend",
        "project/scene.blend",
        "project/textures/wood.png",
    ]
    root = web_settings.storage_dir / "uploads" / rec["upload_id"] / "files" / "project"
    assert (root / "textures" / "wood.png").read_bytes() == PNG.read_bytes()


async def _chunks(data: bytes, size: int = 1 << 20) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.mark.parametrize(
    ("case", "status", "code", "words"),
    [
        ("not_blend", 400, "bad_blend_file", "PNG"),
        ("truncated", 400, "bad_blend_file", "truncated"),
        ("over_limit", 413, "too_large", "FARM_UPLOAD_MAX_BYTES"),
        ("zip_dotdot", 400, "bad_archive", ".."),
        ("zip_absolute", 400, "bad_archive", "absolute"),
        ("zip_link", 400, "bad_archive", "link"),
        ("zip_bomb", 413, "too_large", "FARM_UNPACK_MAX_BYTES"),
        ("gzip_bomb", 413, "too_large", "FARM_UNPACK_MAX_BYTES"),
        ("zip_without_blend", 400, "bad_archive", "no .blend"),
    ],
)
async def test_bad_uploads_get_a_4xx_and_leave_nothing(
    web_settings: Settings, tokens: Tokens, case: str, status: int, code: str, words: str
) -> None:
    plain = PLAIN.read_bytes()
    zeros = bytes(17 << 20)
    bodies: dict[str, Any] = {
        "not_blend": PNG.read_bytes(),
        "truncated": plain[: len(plain) // 2],
        # streamed without a length: the limit is enforced as bytes arrive
        "over_limit": _chunks(b"BLENDER-v279" + bytes(9 << 20)),
        "zip_dotdot": _zip([("scene.blend", plain), ("../../etc/evil.png", b"x")]),
        "zip_absolute": _zip([("scene.blend", plain), ("/etc/evil.png", b"x")]),
        "zip_link": _zip([("scene.blend", plain), _link_entry("tex.png", "/etc/passwd")]),
        "zip_bomb": _zip([("scene.blend", plain), ("big.bin", zeros)]),
        "gzip_bomb": gzip.compress(b"BLENDER-v279" + zeros),
        "zip_without_blend": _zip([("textures/a.png", PNG.read_bytes())]),
    }
    async with api(web_settings) as client:
        resp = await _put(client, tokens.alice, "upload.blend", bodies[case])
        assert resp.status == status, await resp.text()
        err = (await resp.json())["error"]
        assert err["code"] == code
        assert words in err["message"]
        # the server goes on serving
        assert (await client.get("/api/me", headers=bearer(tokens.alice))).status == 200
    assert _leftovers(web_settings) == []


async def test_viewer_cannot_upload_and_outsider_sees_no_project(
    web_settings: Settings, tokens: Tokens
) -> None:
    async with api(web_settings) as client:
        assert (await _put(client, tokens.vera, "a.blend", PLAIN.read_bytes())).status == 403
        assert (await _put(client, tokens.bob, "a.blend", PLAIN.read_bytes())).status == 404
    assert _leftovers(web_settings) == []


async def _interrupted_patch(
    client: TestClient[Any, Any], token: str, sid: str, offset: int, chunk: bytes, sent: int
) -> None:
    """A PATCH whose connection drops after ``sent`` of the chunk's bytes."""
    _reader, writer = await asyncio.open_connection(client.host, client.port)
    head = (
        f"PATCH /api/uploads/sessions/{sid} HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {token}\r\nUpload-Offset: {offset}\r\n"
        f"Content-Length: {len(chunk)}\r\nContent-Type: application/octet-stream\r\n\r\n"
    ).encode()
    writer.write(head + chunk[:sent])
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def test_an_interrupted_resumable_upload_continues_and_equals_the_original(
    web_settings: Settings, tokens: Tokens
) -> None:
    data = PLAIN.read_bytes()
    alice = bearer(tokens.alice)
    async with api(web_settings) as client:
        made = await client.post(
            "/api/uploads/sessions",
            json={"project": "A", "name": "big.blend", "size": len(data)},
            headers=alice,
        )
        assert made.status == 201
        sid = (await made.json())["session_id"]
        first = await client.patch(
            f"/api/uploads/sessions/{sid}",
            data=data[:100_000],
            headers={**alice, "Upload-Offset": "0"},
        )
        assert (await first.json())["offset"] == 100_000
        wrong = await client.patch(
            f"/api/uploads/sessions/{sid}", data=b"x", headers={**alice, "Upload-Offset": "5"}
        )
        assert wrong.status == 409
        assert (await wrong.json())["error"]["offset"] == 100_000
        # the connection drops 150 000 bytes into a 400 000 byte chunk
        await _interrupted_patch(client, tokens.alice, sid, 100_000, data[100_000:500_000], 150_000)
        # the client resumes as a real one does: ask where the upload stands, send from there
        # (409 while the server still writes the dropped chunk), within a time limit
        deadline = time.monotonic() + 10
        while True:
            state = await (await client.get(f"/api/uploads/sessions/{sid}", headers=alice)).json()
            offset = state["offset"]
            assert 100_000 <= offset <= 250_000
            if offset < len(data):
                early = await client.post(f"/api/uploads/sessions/{sid}/complete", headers=alice)
                assert early.status == 409
            rest = await client.patch(
                f"/api/uploads/sessions/{sid}",
                data=data[offset:],
                headers={**alice, "Upload-Offset": str(offset)},
            )
            if rest.status == 200 or time.monotonic() > deadline:
                break
            assert rest.status == 409
            await asyncio.sleep(0.05)
        assert (await rest.json())["offset"] == len(data)
        done = await client.post(f"/api/uploads/sessions/{sid}/complete", headers=alice)
        assert done.status == 201, await done.text()
        rec = await done.json()
    assert rec["upload_id"] == hashlib.sha256(data).hexdigest()
    stored = web_settings.storage_dir / "uploads" / rec["upload_id"] / "upload.blend"
    assert stored.read_bytes() == data


async def test_uploads_land_in_s3_when_storage_is_a_bucket(
    web_settings: Settings, tokens: Tokens, s3_endpoint: str, bucket: str
) -> None:
    from farm.storage.factory import open_storage

    settings = web_settings.with_(
        storage_url=f"s3://{bucket}/farm", s3_endpoint_url=s3_endpoint, s3_addressing_style="path"
    )
    data = _zip([("scene.blend", PLAIN.read_bytes()), ("textures/wood.png", PNG.read_bytes())])
    async with api(settings) as client:
        resp = await _put(client, tokens.alice, "shot.zip", data)
        assert resp.status == 201, await resp.text()
        sha = (await resp.json())["upload_id"]
        bad = await _put(client, tokens.alice, "bad.zip", _zip([("../x.blend", b"x")]))
        assert bad.status == 400
    store = open_storage(settings.storage_url, settings)
    try:
        keys = [o.key for o in store.list("uploads/")]
    finally:
        store.close()
    assert keys == [f"uploads/{sha}/files/scene.blend", f"uploads/{sha}/files/textures/wood.png"]
