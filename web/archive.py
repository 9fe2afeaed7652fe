"""Unpacking an uploaded zip (a .blend with its textures and libraries) safely and within limits."""

from __future__ import annotations

import re
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from farm.errors import BadArchive, TooLarge

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
CHUNK = 1 << 20
MAX_MEMBERS = 100_000
#: folders macOS adds to zips it makes; never part of the scene
IGNORED_PREFIXES = ("__MACOSX/",)


@dataclass(frozen=True)
class Unpacked:
    files: list[str]
    """Every file's path inside the archive, sanitized, sorted."""
    blend: str
    """The .blend to render: the shallowest one (the first by name among equals)."""
    total_bytes: int


def is_zip(head: bytes) -> bool:
    return head.startswith(ZIP_MAGIC)


def safe_member_name(raw: str) -> str | None:
    """The member's path relative to the archive root; None for a folder entry.

    Raises BadArchive for an absolute path, a ``..`` component or a NUL byte.
    """
    name = raw.replace("\\", "/")
    if "\0" in name:
        raise BadArchive(f"the zip entry {raw!r} has a NUL byte in its name", entry=raw)
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise BadArchive(
            f"the zip entry {raw!r} has an absolute path; zip the folder with relative paths",
            entry=raw,
        )
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if ".." in parts:
        raise BadArchive(
            f"the zip entry {raw!r} points outside the archive (..); remove it and zip again",
            entry=raw,
        )
    if name.endswith("/") or not parts:
        return None
    return "/".join(parts)


def _check_type(info: zipfile.ZipInfo, name: str) -> None:
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise BadArchive(
            f"the zip entry {name!r} is a symbolic link; links are not accepted, zip the file "
            "itself",
            entry=name,
        )
    if mode and stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
        raise BadArchive(f"the zip entry {name!r} is not a regular file", entry=name)


def unpack(archive: Path, dest: Path, limit: int) -> Unpacked:
    """Check every entry, then extract into ``dest`` counting the bytes actually written.

    The sizes a zip declares are checked first (cheap), the real bytes while extracting (a
    crafted zip can lie about them). Anything wrong raises before or during extraction; the
    caller removes ``dest``.
    """
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError) as exc:
        raise BadArchive(f"the upload is not a readable zip: {exc}") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_MEMBERS:
            raise BadArchive(f"the zip has {len(infos)} entries; at most {MAX_MEMBERS} allowed")
        members: list[tuple[zipfile.ZipInfo, str]] = []
        seen: set[str] = set()
        declared = 0
        for info in infos:
            name = safe_member_name(info.filename)
            if name is None:
                continue
            _check_type(info, name)
            if name.startswith(IGNORED_PREFIXES):
                continue
            if name.lower() in seen:
                raise BadArchive(f"the zip holds {name!r} twice", entry=name)
            seen.add(name.lower())
            if info.flag_bits & 0x1:
                raise BadArchive(f"the zip entry {name!r} is encrypted; zip it without a password")
            declared += info.file_size
            if declared > limit:
                raise TooLarge(
                    f"the zip unpacks to more than {limit} bytes (FARM_UNPACK_MAX_BYTES)",
                    limit=limit,
                )
            members.append((info, name))
        blends = sorted(
            (n for _i, n in members if n.lower().endswith(".blend")),
            key=lambda n: (n.count("/"), n),
        )
        if not blends:
            raise BadArchive("the zip holds no .blend file; put the scene's .blend in it")
        written = 0
        for info, name in members:
            target = dest / name
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, target.open("xb") as out:
                    while chunk := src.read(CHUNK):
                        written += len(chunk)
                        if written > limit:
                            raise TooLarge(
                                f"the zip unpacks to more than {limit} bytes "
                                "(FARM_UNPACK_MAX_BYTES)",
                                limit=limit,
                            )
                        out.write(chunk)
            except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
                if isinstance(exc, FileExistsError):
                    raise BadArchive(f"the zip holds {name!r} twice", entry=name) from None
                raise BadArchive(f"the zip entry {name!r} is corrupt: {exc}", entry=name) from None
    return Unpacked(sorted(n for _i, n in members), blends[0], written)
