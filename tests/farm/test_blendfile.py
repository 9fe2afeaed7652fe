"""Tests of the structural .blend check on real files from Blender 2.79, 3.3 and 5.0."""

from __future__ import annotations

import gzip
import io
import os
import random
import struct
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from farm.blendfile import BlendInfo, check_blend
from farm.errors import BadBlendFile
from tests.conftest import REPO, TESTDATA

REAL_FILES = [
    ("01_missing_textures.blend", "2.79"),
    ("01_principled_material.blend", "2.79"),
    ("12_anim_range_driver.blend", "3.3"),
]

SAVE_SCRIPT = """
import sys
import bpy
bpy.ops.wm.save_as_mainfile(filepath=sys.argv[1], compress=True)
bpy.ops.wm.save_as_mainfile(filepath=sys.argv[2], compress=False)
"""


@pytest.fixture(scope="session")
def blend5(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The default scene saved by bpy 5.0: zstd-compressed, uncompressed, and gzipped by us."""
    folder = tmp_path_factory.mktemp("blend5")
    files = {"zstd": folder / "zstd.blend", "none": folder / "none.blend"}
    subprocess.run(
        [sys.executable, "-c", SAVE_SCRIPT, str(files["zstd"]), str(files["none"])],
        check=True,
        capture_output=True,
        timeout=120,
    )
    # Blender up to 4.x compressed with gzip; it still reads such files.
    files["gzip"] = folder / "gzip.blend"
    files["gzip"].write_bytes(gzip.compress(files["none"].read_bytes()))
    return files


def write(folder: Path, data: bytes, name: str = "upload.blend") -> Path:
    path = folder / name
    path.write_bytes(data)
    return path


def rejected(path: Path) -> BadBlendFile:
    with pytest.raises(BadBlendFile) as raised:
        check_blend(path)
    error = raised.value
    assert "\n" not in error.message
    assert error.fields["path"] == str(path)
    return error


# --- files that pass --------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "version"), REAL_FILES)
def test_real_old_files_pass(name: str, version: str) -> None:
    path = TESTDATA / name
    info = check_blend(path)
    assert info == BlendInfo(
        compression="none",
        pointer_size=8,
        endian="little",
        version=version,
        file_format_version=0,
        size_bytes=path.stat().st_size,
        blocks=info.blocks,
    )
    assert info.blocks > 1000


def test_blender5_files_pass_compressed_and_not(blend5: dict[str, Path]) -> None:
    infos = {kind: check_blend(path) for kind, path in blend5.items()}
    for kind, info in infos.items():
        assert info.compression == kind
        assert (info.version, info.file_format_version) == ("5.0", 1)
        assert (info.pointer_size, info.endian) == (8, "little")
        assert info.size_bytes == blend5[kind].stat().st_size
    # The same scene, so the same blocks whichever way it was compressed.
    assert len({info.blocks for info in infos.values()}) == 1
    assert infos["zstd"].size_bytes < infos["none"].size_bytes


def test_gzipped_old_file_passes(tmp_path: Path) -> None:
    raw = (TESTDATA / "12_anim_range_driver.blend").read_bytes()
    info = check_blend(write(tmp_path, gzip.compress(raw)))
    assert info.compression == "gzip"
    assert info.version == "3.3"
    assert info.blocks == check_blend(TESTDATA / "12_anim_range_driver.blend").blocks


def old_blend(
    pointer: bytes, endian: bytes, digits: bytes, codes: list[tuple[bytes, int]]
) -> bytes:
    """A minimal old-header .blend: the given (code, length) blocks, then ENDB."""
    order = "<" if endian == b"v" else ">"
    bhead = struct.Struct(f"{order}4siIii" if pointer == b"_" else f"{order}4siQii")
    out = io.BytesIO()
    out.write(b"BLENDER" + pointer + endian + digits)
    for code, length in [*codes, (b"ENDB", 0)]:
        out.write(bhead.pack(code, length, 0x1000, 0, 1))
        out.write(b"\xab" * max(length, 0))
    return out.getvalue()


def test_four_byte_pointer_big_endian_file_passes(tmp_path: Path) -> None:
    data = old_blend(b"_", b"V", b"249", [(b"REND", 72), (b"GLOB", 104), (b"DATA", 0)])
    info = check_blend(write(tmp_path, data))
    assert (info.pointer_size, info.endian, info.version) == (4, "big", "2.49")
    assert info.blocks == 4


def test_zstd_without_seek_table_passes(blend5: dict[str, Path], tmp_path: Path) -> None:
    # Blender 5 ends its zstd files with a seek table in a skippable frame, but reads files
    # without one (as the zstd command line writes them), so the check must too.
    import zstandard

    data = zstandard.ZstdCompressor().compress(blend5["none"].read_bytes())
    assert check_blend(write(tmp_path, data)).compression == "zstd"


# --- truncation -------------------------------------------------------------------------------

FRACTIONS = [i / 30 for i in range(30)]


@pytest.mark.parametrize("kind", ["none", "zstd", "gzip"])
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_truncated_files_are_rejected(
    blend5: dict[str, Path], tmp_path: Path, kind: str, fraction: float
) -> None:
    data = blend5[kind].read_bytes()
    cut = int(len(data) * fraction)
    error = rejected(write(tmp_path, data[:cut]))
    assert error.fields["reason"] == ("empty" if cut == 0 else "truncated")
    if cut:
        assert "save it again or re-upload" in error.message


@pytest.mark.parametrize("kind", ["none", "zstd", "gzip"])
def test_files_cut_near_either_end_are_rejected(
    blend5: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    data = blend5[kind].read_bytes()
    # The header, the first block headers, and the end: ENDB, Blender's zstd seek table.
    for cut in [*range(1, 80), *range(len(data) - 80, len(data))]:
        trimmed = data[:cut]
        if kind == "zstd" and trimmed == seek_table_stripped(data):
            continue  # a complete stream without its optional seek table, see the test above
        error = rejected(write(tmp_path, trimmed))
        assert error.fields["reason"] == "truncated", (cut, error.message)


def seek_table_stripped(data: bytes) -> bytes:
    """The zstd stream without its trailing skippable frame (Blender's seek table)."""
    # num_frames * (compressed size, decompressed size) u32 pairs, plus the 9-byte footer
    table_bytes = 8 + struct.unpack_from("<I", data, len(data) - 9)[0] * 8 + 9
    return data[: len(data) - table_bytes]


def test_truncation_message_says_where(blend5: dict[str, Path], tmp_path: Path) -> None:
    data = blend5["none"].read_bytes()
    error = rejected(write(tmp_path, data[:100_000]))
    assert error.message.startswith("upload.blend is truncated at byte 100000 of ")
    assert error.fields["offset"] == 100_000
    assert error.fields["expected_bytes"] > 100_000


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_any_truncation_of_the_uncompressed_file_is_rejected(
    blend5: dict[str, Path], tmp_path: Path, data: st.DataObject
) -> None:
    raw = blend5["none"].read_bytes()
    cut = data.draw(st.integers(min_value=1, max_value=len(raw) - 1))
    assert rejected(write(tmp_path, raw[:cut])).fields["reason"] == "truncated"


# --- damaged files: only ever BadBlendFile ----------------------------------------------------


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_damaged_files_raise_only_bad_blend_file(
    blend5: dict[str, Path], tmp_path: Path, data: st.DataObject
) -> None:
    kind = data.draw(st.sampled_from(["none", "zstd", "gzip"]))
    damaged = bytearray(blend5[kind].read_bytes())
    # Damage the start, where headers and small blocks are dense, more often than the middle.
    limit = data.draw(st.sampled_from([200, 4000, len(damaged) - 1]))
    for _ in range(data.draw(st.integers(1, 4))):
        offset = data.draw(st.integers(0, limit))
        damaged[offset] = data.draw(st.integers(0, 255))
    path = write(tmp_path, bytes(damaged))
    try:
        check_blend(path)
    except BadBlendFile as error:
        assert "\n" not in error.message


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(min_size=1, max_size=300))
def test_random_bytes_are_rejected(tmp_path: Path, data: bytes) -> None:
    rejected(write(tmp_path, data))


def test_negative_block_length_is_corruption(tmp_path: Path) -> None:
    data = old_blend(b"-", b"v", b"279", [(b"REND", 72), (b"DATA", -5)])
    error = rejected(write(tmp_path, data))
    assert error.fields["reason"] == "corrupt_block"
    assert error.fields["offset"] == 12 + 24 + 72
    assert "a negative length;" in error.message
    assert "-5" not in error.message  # a length a user cannot act on, and not one Blender wrote


def test_zeroed_block_header_is_corruption_not_truncation(tmp_path: Path) -> None:
    """A run of zero bytes where a block header belongs (a disk or copy fault) is corruption at
    that offset; walked as empty blocks it would end as "truncated" at the end of the file."""
    data = bytearray(old_blend(b"-", b"v", b"279", [(b"REND", 72), (b"DATA", 64), (b"TEST", 8)]))
    start = 12 + 24 + 72
    data[start : start + 4096] = bytes(min(4096, len(data) - start))
    error = rejected(write(tmp_path, bytes(data)))
    assert error.fields["reason"] == "corrupt_block"
    assert error.fields["offset"] == start
    assert "only zero bytes" in error.message


def test_absurd_block_length_is_corruption(tmp_path: Path) -> None:
    head = b"BLENDER17-01v0500"
    block = struct.pack("<4siQqq", b"DATA", 0, 0x1000, 1 << 50, 1)
    error = rejected(write(tmp_path, head + block + b"\0" * 64))
    assert error.fields["reason"] == "corrupt_block"


def test_garbage_block_code_is_corruption(tmp_path: Path) -> None:
    data = old_blend(b"-", b"v", b"279", [(b"REND", 8), (b"\x01\xff\x80\x00", 8)])
    assert rejected(write(tmp_path, data)).fields["reason"] == "corrupt_block"


def test_corrupt_gzip_is_rejected(blend5: dict[str, Path], tmp_path: Path) -> None:
    damaged = bytearray(blend5["gzip"].read_bytes())
    damaged[-6] ^= 0xFF  # inside the CRC32 of the gzip trailer
    error = rejected(write(tmp_path, bytes(damaged)))
    assert error.fields["reason"] == "corrupt_compressed"
    assert "gzip" in error.message


def test_corrupt_zstd_frame_header_is_rejected(blend5: dict[str, Path], tmp_path: Path) -> None:
    damaged = bytearray(blend5["zstd"].read_bytes())
    damaged[0] ^= 0xFF  # the frame magic: not zstd any more, so not a .blend either
    assert rejected(write(tmp_path, bytes(damaged))).fields["reason"] == "not_blend"
    damaged = bytearray(blend5["zstd"].read_bytes())
    damaged[5] ^= 0x55
    error = rejected(write(tmp_path, bytes(damaged)))
    assert error.fields["reason"] in ("corrupt_compressed", "truncated")


# --- headers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "version", "pointer_size"),
    [(b"BLENDER-v279", "2.79", 8), (b"BLENDER_v303", "3.3", 4), (b"BLENDER-v402", "4.2", 8)],
)
def test_old_header_versions(
    tmp_path: Path, header: bytes, version: str, pointer_size: int
) -> None:
    data = old_blend(header[7:8], header[8:9], header[9:12], [])
    info = check_blend(write(tmp_path, data))
    assert (info.version, info.pointer_size, info.file_format_version) == (version, pointer_size, 0)


@pytest.mark.parametrize(
    ("header", "newer"),
    [
        (b"BLENDER17-02v0600", True),
        (b"BLENDER17-01x0500", False),
        (b"BLENDER17-01v05a0", False),
        (b"BLENDER*v279", False),
        (b"BLENDER-v2a9", False),
    ],
)
def test_unknown_headers_are_rejected(tmp_path: Path, header: bytes, newer: bool) -> None:
    error = rejected(write(tmp_path, header + b"\0" * 64))
    assert error.fields["reason"] == "unknown_header"
    assert ("newer Blender" in error.message) == newer


# --- things that are not .blend files ---------------------------------------------------------


def test_empty_file(tmp_path: Path) -> None:
    error = rejected(write(tmp_path, b""))
    assert error.fields["reason"] == "empty"
    assert error.message == "upload.blend is empty (0 bytes); save it again or re-upload"


def test_png_image(tmp_path: Path) -> None:
    error = rejected(TESTDATA / "01_principled_normal.png")
    assert (
        error.message == "01_principled_normal.png is not a .blend file: it looks like a PNG image"
    )
    assert error.fields["reason"] == "not_blend"


def test_zip_archive_says_what_to_upload(blend5: dict[str, Path], tmp_path: Path) -> None:
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zf:
        zf.write(blend5["none"], "scene.blend")
    error = rejected(write(tmp_path, archive.getvalue(), "scene.zip"))
    assert error.fields["looks_like"].startswith("a zip archive")
    assert "upload the .blend inside" in error.message


def test_text_file(tmp_path: Path) -> None:
    error = rejected(write(tmp_path, "import bpy\nprint('héllo')\n".encode()))
    assert error.fields["looks_like"] == "text"


def test_compressed_text_says_so(tmp_path: Path) -> None:
    error = rejected(write(tmp_path, gzip.compress(b"just some notes\n")))
    assert error.fields["looks_like"] == "gzip-compressed text"


def test_random_bytes(tmp_path: Path) -> None:
    data = bytes([0x00, 0x13]) + random.Random(7).randbytes(4094)
    error = rejected(write(tmp_path, data))
    assert error.fields["reason"] == "not_blend"
    assert error.fields["looks_like"].startswith("unrecognised data (first bytes 00 13")


def test_directory(tmp_path: Path) -> None:
    error = rejected(tmp_path)
    assert error.message == f"{tmp_path} is a directory, not a .blend file"


def test_named_pipe_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    """A FIFO named x.blend: opening it for reading blocks until someone writes, forever."""
    fifo = tmp_path / "x.blend"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []
    checker = threading.Thread(target=lambda: outcome.append(rejected(fifo)), daemon=True)
    checker.start()
    checker.join(10)
    if checker.is_alive():
        with fifo.open("wb"):  # unblock the reader so the thread ends, then fail
            pass
        checker.join(10)
        pytest.fail("check_blend blocked on a named pipe with no writer")
    assert str(outcome[0]) == f"{fifo} is a named pipe (FIFO), not a .blend file"


def test_device_is_refused() -> None:
    assert (
        rejected(Path("/dev/zero")).message == "/dev/zero is a character device, not a .blend file"
    )


def test_missing_file(tmp_path: Path) -> None:
    assert "does not exist" in rejected(tmp_path / "gone.blend").message


def test_unreadable_file(tmp_path: Path) -> None:
    path = write(tmp_path, b"BLENDER-v279")
    path.chmod(0)
    if os.geteuid() != 0:
        assert "cannot be read" in rejected(path).message
        return
    # root reads files whatever their mode: the check runs in a child without the capabilities
    # that let it (dropped from the bounding set, so the child's exec never gets them back)
    child = subprocess.run(
        ["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c",
         UNREADABLE_CHILD, str(path)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == f"{path} cannot be read (Permission denied)"


UNREADABLE_CHILD = """
import sys
from farm.blendfile import check_blend
from farm.errors import BadBlendFile
try:
    check_blend(sys.argv[1])
except BadBlendFile as error:
    print(error.message)
"""
