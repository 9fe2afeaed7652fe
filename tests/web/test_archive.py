"""Zip entry names: whatever a zip says, an accepted name stays inside the unpack folder."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from farm.errors import BadArchive
from web.archive import safe_member_name


@pytest.mark.parametrize(
    ("raw", "safe"),
    [
        ("scene.blend", "scene.blend"),
        ("./shot//textures/a.png", "shot/textures/a.png"),
        ("shot\\textures\\a.png", "shot/textures/a.png"),
        ("textures/", None),
    ],
)
def test_relative_names_are_kept_and_folders_skipped(raw: str, safe: str | None) -> None:
    assert safe_member_name(raw) == safe


@pytest.mark.parametrize("raw", ["/etc/passwd", "C:/x.blend", "a/../../x", "..\\x", "a\0b"])
def test_names_leaving_the_archive_are_refused(raw: str) -> None:
    with pytest.raises(BadArchive):
        safe_member_name(raw)


@given(st.text(alphabet="ab./\\:C\0", max_size=12))
def test_no_accepted_name_escapes_the_unpack_folder(raw: str) -> None:
    try:
        name = safe_member_name(raw)
    except BadArchive:
        return
    if name is None:
        return
    root = Path("/unpack")
    target = (root / name).resolve()
    assert target.is_relative_to(root) and target != root
    assert ".." not in PurePosixPath(name).parts
