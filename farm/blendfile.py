"""The structural check of a .blend file without Blender: header, compression and block walk."""

from __future__ import annotations

import gzip
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import zstandard

from farm.errors import BadBlendFile

#: decompressed bytes handed to the block walker at a time
CHUNK_BYTES = 1 << 20
#: a block longer than this is corruption, not data (Blender writes arrays well below it)
MAX_BLOCK_BYTES = 1 << 40
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ZSTD_FRAME_MAGIC = 0xFD2FB528
ZSTD_SKIPPABLE_MAGIC_LOW = 0x184D2A50
SAVE_AGAIN = "save it again or re-upload"
#: bytes allowed in a block code: ID codes ("OB\0\0"), DATA, REND, GLOB, DNA1, TEST, ENDB
CODE_BYTES = frozenset(b"\0 _0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
#: the code of a block header that was zeroed (no Blender block has an empty code)
ZEROED_CODE = b"\0\0\0\0"


@dataclass(frozen=True)
class BlendInfo:
    """What the header and block walk of a sound .blend file tell."""

    compression: str
    """``none``, ``gzip`` or ``zstd`` (Blender 5 saves zstd by default)."""
    pointer_size: int
    """4 or 8: the size of pointers on the machine that saved the file."""
    endian: str
    """``little`` or ``big``."""
    version: str
    """The Blender version from the header digits: ``2.79``, ``3.3``, ``5.0``."""
    file_format_version: int
    """0 for the 12-byte header of Blender <= 4.x, 1 for the 17-byte header of Blender 5."""
    size_bytes: int
    """Size of the file on disk (compressed when it is compressed)."""
    blocks: int
    """Number of file blocks, the closing ENDB block included."""


@dataclass(frozen=True)
class _Layout:
    """How the block headers of one file are laid out."""

    header_bytes: int
    bhead: struct.Struct
    large: bool

    def unpack(self, buf: bytes, offset: int) -> tuple[bytes, int, int]:
        """(code, length, count) of the block header at offset."""
        if self.large:
            code, _sdna, _old, length, count = self.bhead.unpack_from(buf, offset)
        else:
            code, length, _old, _sdna, count = self.bhead.unpack_from(buf, offset)
        return code, length, count


@dataclass(frozen=True)
class _Header:
    """What the first 12 or 17 bytes say."""

    layout: _Layout
    pointer_size: int
    endian: str
    version: str
    file_format_version: int


# --- where the bytes come from ----------------------------------------------------------------


class _Source(Protocol):
    kind: str

    def read(self) -> bytes:
        """The next chunk of decompressed bytes; b"" at the end."""

    def skip(self, count: int) -> int | None:
        """Skip count bytes cheaply and say how many were there; None when it cannot seek."""


class _RawSource:
    kind = "none"

    def __init__(self, file: BinaryIO, size: int) -> None:
        self._file = file
        self._size = size

    def read(self) -> bytes:
        return self._file.read(CHUNK_BYTES)

    def skip(self, count: int) -> int:
        here = self._file.tell()
        target = min(here + count, self._size)
        self._file.seek(target)
        return target - here


class _GzipSource:
    kind = "gzip"

    def __init__(self, file: BinaryIO, path: Path, size: int) -> None:
        self._raw = file
        self._gzip = gzip.GzipFile(fileobj=file, mode="rb")
        self._path = path
        self._size = size

    def read(self) -> bytes:
        try:
            return self._gzip.read(CHUNK_BYTES)
        except EOFError:
            raise _compressed_truncated(self._path, "gzip", self._size) from None
        except (OSError, zlib.error) as error:
            raise _compressed_corrupt(self._path, "gzip", self._raw.tell(), error) from None

    def skip(self, count: int) -> None:
        return None


class _ZstdSource:
    """Zstandard frames one after another, skippable frames (Blender's seek table) included."""

    kind = "zstd"

    def __init__(self, file: BinaryIO, path: Path, size: int) -> None:
        _check_zstd_frames(file, path, size)
        file.seek(0)
        self._path = path
        self._raw = file
        # A reader (not a decompression object) bounds the output of each call, so a tiny
        # upload that decompresses to gigabytes is walked a chunk at a time.
        self._reader = zstandard.ZstdDecompressor().stream_reader(
            file, read_across_frames=True, closefd=False
        )

    def read(self) -> bytes:
        try:
            data: bytes = self._reader.read(CHUNK_BYTES)
        except zstandard.ZstdError as error:
            raise _compressed_corrupt(self._path, "zstd", self._raw.tell(), error) from None
        return data

    def skip(self, count: int) -> None:
        return None


def _check_zstd_frames(file: BinaryIO, path: Path, size: int) -> None:
    """Walk zstd frame and block headers; raise when the last frame is cut off.

    The stream reader returns short data without complaint when the input ends inside a
    frame, so a truncated upload would otherwise pass whenever the cut falls after ENDB
    (in the last frame or Blender's seek table). Block headers are 3 bytes per <= 128 KiB of
    data, so this costs a few seeks, not a decompression.
    """

    def read_at(offset: int, count: int) -> bytes:
        file.seek(offset)
        data = file.read(count)
        if len(data) < count:
            raise _compressed_truncated(path, "zstd", size)
        return data

    pos = 0
    while pos < size:
        magic = int.from_bytes(read_at(pos, 4), "little")
        if magic & 0xFFFFFFF0 == ZSTD_SKIPPABLE_MAGIC_LOW:
            pos += 8 + int.from_bytes(read_at(pos + 4, 4), "little")
            continue
        if magic != ZSTD_FRAME_MAGIC:
            raise _compressed_corrupt(path, "zstd", pos, ValueError(f"no frame at byte {pos}"))
        descriptor = read_at(pos + 4, 1)[0]
        single_segment = descriptor >> 5 & 1
        content_size_bytes = (single_segment, 2, 4, 8)[descriptor >> 6]
        dictionary_id_bytes = (0, 1, 2, 4)[descriptor & 3]
        pos += 5 + (1 - single_segment) + dictionary_id_bytes + content_size_bytes
        while True:
            block = int.from_bytes(read_at(pos, 3), "little")
            block_type, block_bytes = block >> 1 & 3, block >> 3
            if block_type == 3:
                raise _compressed_corrupt(
                    path, "zstd", pos, ValueError(f"reserved block type at byte {pos}")
                )
            # An RLE block stores one byte however many it stands for.
            pos += 3 + (1 if block_type == 1 else block_bytes)
            if block & 1:
                break
        pos += 4 * (descriptor >> 2 & 1)  # content checksum
    if pos > size:
        raise _compressed_truncated(path, "zstd", size)


# --- errors a user can act on -----------------------------------------------------------------


def _bad(path: Path, message: str, reason: str, **fields: object) -> BadBlendFile:
    # The file name is enough where the path was accepted; a path that fails to open is shown whole.
    name = path if reason == "unreadable" else path.name
    return BadBlendFile(f"{name} {message}", path=str(path), reason=reason, **fields)


def _compressed_truncated(path: Path, kind: str, size: int) -> BadBlendFile:
    return _bad(
        path,
        f"is truncated: its {kind} stream is cut off at byte {size}; {SAVE_AGAIN}",
        "truncated",
        offset=size,
        size_bytes=size,
        compression=kind,
    )


def _compressed_corrupt(path: Path, kind: str, offset: int, error: Exception) -> BadBlendFile:
    return _bad(
        path,
        f"has corrupt {kind} data ({error}); {SAVE_AGAIN}",
        "corrupt_compressed",
        # Where reading the compressed bytes had got to: the damage lies at or before it.
        offset=offset,
        compression=kind,
    )


def _truncated(path: Path, have: int, want: int | None, compression: str) -> BadBlendFile:
    where = f"byte {have} of {want}" if want is not None else f"byte {have} (no end block)"
    if compression != "none":
        where += f" of its {compression}-decompressed data"
    return _bad(
        path,
        f"is truncated at {where}; {SAVE_AGAIN}",
        "truncated",
        offset=have,
        expected_bytes=want,
        compression=compression,
    )


def _looks_like(head: bytes) -> str:
    """A guess at what a file that is not a .blend is, from its first bytes."""
    signatures: tuple[tuple[bytes, str], ...] = (
        (b"\x89PNG\r\n\x1a\n", "a PNG image"),
        (b"\xff\xd8\xff", "a JPEG image"),
        (b"v/1\x01", "an OpenEXR image"),
        (b"GIF8", "a GIF image"),
        (b"BM", "a BMP image"),
        (b"PK\x03\x04", "a zip archive (upload the .blend inside, or a zip via the web upload)"),
        (b"PK\x05\x06", "an empty zip archive"),
        (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive (upload the .blend inside)"),
        (b"Rar!", "a RAR archive (upload the .blend inside)"),
        (b"%PDF", "a PDF document"),
        (b"\x7fELF", "a program (ELF executable)"),
        (b"MZ", "a Windows program"),
    )
    for magic, description in signatures:
        if head.startswith(magic):
            return description
    if head[257:262] == b"ustar":
        return "a tar archive (upload the .blend inside)"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "a WebP image"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        # A multi-byte character may be cut at the end of the sniffed bytes.
        try:
            text = head[:-3].decode("utf-8")
        except UnicodeDecodeError:
            text = "\0"
    if "\0" not in text and all(ch.isprintable() or ch in "\t\r\n\f" for ch in text):
        return "text"
    return f"unrecognised data (first bytes {head[:8].hex(' ')})"


# --- the check --------------------------------------------------------------------------------


def check_blend(path: Path) -> BlendInfo:
    """Check that path holds a complete .blend file; raise BadBlendFile saying what is wrong."""
    path = Path(path)
    with open_regular(path) as file:
        try:
            return _check_open(path, file)
        except OSError as error:
            raise _bad(path, f"cannot be read ({error.strerror})", "unreadable") from None


#: what a path that is not a regular file is, by its ``stat`` type
_NOT_FILES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading if it is a regular file; BadBlendFile otherwise.

    Opened without blocking: a named pipe with no writer would otherwise hang the open forever,
    and a device could stream without end. The type comes from the open file, not the name, so a
    path swapped for a pipe after a check is still refused.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _bad(path, "does not exist", "unreadable") from None
    except OSError as error:
        raise _bad(path, f"cannot be read ({error.strerror})", "unreadable") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _NOT_FILES if test(mode)), "not a regular file")
        raise _bad(path, f"is {kind}, not a .blend file", "unreadable")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _check_open(path: Path, file: BinaryIO) -> BlendInfo:
    size = file.seek(0, 2)
    file.seek(0)
    head = file.read(4)
    file.seek(0)
    if not head:
        raise _bad(path, f"is empty (0 bytes); {SAVE_AGAIN}", "empty", size_bytes=0)
    source: _Source
    if head.startswith(GZIP_MAGIC):
        source = _GzipSource(file, path, size)
    elif head.startswith(ZSTD_MAGIC) or (
        len(head) >= 4
        and int.from_bytes(head[:4], "little") & 0xFFFFFFF0 == ZSTD_SKIPPABLE_MAGIC_LOW
    ):
        source = _ZstdSource(file, path, size)
    else:
        source = _RawSource(file, size)
    header, blocks = _walk(path, source)
    return BlendInfo(
        compression=source.kind,
        pointer_size=header.pointer_size,
        endian=header.endian,
        version=header.version,
        file_format_version=header.file_format_version,
        size_bytes=size,
        blocks=blocks,
    )


def _parse_header(path: Path, head: bytes, compression: str) -> _Header:
    """The header from the first (decompressed) bytes; what the file looks like if not a .blend."""
    if not head.startswith(b"BLENDER"):
        if any(magic.startswith(head) for magic in (b"BLENDER", GZIP_MAGIC, ZSTD_MAGIC)):
            raise _truncated(path, len(head), None, compression)
        looks = _looks_like(head)
        if compression != "none":
            looks = f"{compression}-compressed {looks}"
        raise _bad(
            path, f"is not a .blend file: it looks like {looks}", "not_blend", looks_like=looks
        )
    if head[7:9] == b"17":
        if len(head) < 17:
            raise _truncated(path, len(head), 17, compression)
        format_digits, endian_char, digits = head[10:12], head[12:13], head[13:17]
        if head[9:10] != b"-" or not format_digits.isdigit() or not digits.isdigit():
            raise _unknown_header(path, head[:17])
        if format_digits != b"01":
            raise _unknown_header(path, head[:17], newer=True)
        pointer_size, file_format = 8, int(format_digits)
        version = f"{int(digits[:2])}.{int(digits[2:])}"
    else:
        if len(head) < 12:
            raise _truncated(path, len(head), 12, compression)
        pointer_char, endian_char, digits = head[7:8], head[8:9], head[9:12]
        if pointer_char not in (b"_", b"-") or not digits.isdigit():
            raise _unknown_header(path, head[:12])
        pointer_size, file_format = (4 if pointer_char == b"_" else 8), 0
        version = f"{digits[:1].decode()}.{int(digits[1:])}"
    if endian_char not in (b"v", b"V"):
        raise _unknown_header(path, head[:17] if file_format else head[:12])
    endian = "little" if endian_char == b"v" else "big"
    order = "<" if endian == "little" else ">"
    if file_format:
        layout = _Layout(17, struct.Struct(f"{order}4siQqq"), large=True)
    elif pointer_size == 8:
        layout = _Layout(12, struct.Struct(f"{order}4siQii"), large=False)
    else:
        layout = _Layout(12, struct.Struct(f"{order}4siIii"), large=False)
    return _Header(layout, pointer_size, endian, version, file_format)


def _unknown_header(path: Path, header: bytes, newer: bool = False) -> BadBlendFile:
    why = "saved by a newer Blender" if newer else "not a header any Blender writes"
    return _bad(
        path,
        f"has a .blend header this farm cannot read ({header.decode('latin-1')!r}, {why}); "
        "save it again with Blender 5.0",
        "unknown_header",
        header=header.decode("latin-1"),
    )


def _walk(path: Path, source: _Source) -> tuple[_Header, int]:
    """Read the header and follow the block headers to ENDB; the header and the block count."""
    # buf holds decompressed bytes from absolute offset base on; pos is the next block header.
    buf = b""
    base = 0
    while len(buf) < 17:
        chunk = source.read()
        if not chunk:
            break
        buf += chunk
    if not buf and source.kind != "none":
        raise _truncated(path, 0, None, source.kind)
    header = _parse_header(path, buf[:512], source.kind)
    layout = header.layout
    header_bytes = layout.bhead.size
    pos = layout.header_bytes
    blocks = 0
    while True:
        end = base + len(buf)
        if pos + header_bytes > end:
            if pos >= end:
                # The block's data is not needed: skip it, seeking where the source can.
                gap = pos - end
                base, buf = end, b""
                skipped = source.skip(gap) if gap else 0
                if skipped is not None:
                    base += skipped
                    if skipped < gap:
                        raise _truncated(path, base, pos + header_bytes, source.kind)
                while base < pos:
                    chunk = source.read()
                    if not chunk:
                        raise _truncated(path, base, pos + header_bytes, source.kind)
                    if base + len(chunk) > pos:
                        buf = chunk[pos - base :]
                        base = pos
                    else:
                        base += len(chunk)
            else:
                buf = buf[pos - base :]
                base = pos
            while len(buf) < header_bytes:
                chunk = source.read()
                if not chunk:
                    if not buf:
                        raise _truncated(path, pos, None, source.kind)
                    raise _truncated(path, base + len(buf), pos + header_bytes, source.kind)
                buf += chunk
        code, length, count = layout.unpack(buf, pos - base)
        blocks += 1
        if not CODE_BYTES.issuperset(code) or code == ZEROED_CODE:
            # zeroes where a block header belongs: a disk or copy fault, not a cut-off file
            what = "only zero bytes" if code == ZEROED_CODE else f"an invalid code {code!r}"
            raise _corrupt_block(path, pos, what)
        if length < 0:
            raise _corrupt_block(path, pos, "a negative length")
        if length > MAX_BLOCK_BYTES:
            raise _corrupt_block(path, pos, f"an impossible length of {length} bytes")
        if count < 0:
            raise _corrupt_block(path, pos, f"an impossible item count of {count}")
        if code == b"ENDB":
            # A compressed stream is read to its end: gzip checks its CRC there, and a cut-off
            # zstd seek table or last frame must not pass as a complete upload.
            if source.kind != "none":
                while source.read():
                    pass
            return header, blocks
        pos += header_bytes + length


def _corrupt_block(path: Path, offset: int, what: str) -> BadBlendFile:
    return _bad(
        path,
        f"is corrupt: the block at byte {offset} has {what}; {SAVE_AGAIN}",
        "corrupt_block",
        offset=offset,
    )


def expanded_size(path: Path, limit: int) -> int:
    """Bytes ``path`` holds once decompressed (its size when it is not compressed).

    Stops reading as soon as the count passes ``limit`` and raises TooLarge, so a small
    compressed upload that would expand to terabytes costs at most ``limit`` bytes of work.
    """
    from farm.errors import TooLarge

    path = Path(path)
    with open_regular(path) as file:
        size = file.seek(0, 2)
        file.seek(0)
        head = file.read(4)
        file.seek(0)
        source: _Source
        if head.startswith(GZIP_MAGIC):
            source = _GzipSource(file, path, size)
        elif head.startswith(ZSTD_MAGIC):
            source = _ZstdSource(file, path, size)
        else:
            if size > limit:
                raise TooLarge(
                    f"{path.name} is {size} bytes, over the limit of {limit}", limit=limit
                )
            return size
        total = 0
        while chunk := source.read():
            total += len(chunk)
            if total > limit:
                raise TooLarge(
                    f"{path.name} expands to more than {limit} bytes ({source.kind}-compressed "
                    f"{size} bytes); the limit is FARM_UNPACK_MAX_BYTES",
                    limit=limit,
                    compression=source.kind,
                )
        return total
