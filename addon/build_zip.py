"""Builds the Blender add-on zip (tessera_submit/ at the zip's root) that Blender installs."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent / "tessera_submit"


def build(out: Path) -> Path:
    """Write the add-on's .py files under ``tessera_submit/`` into the zip ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".zip.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for src in sorted(PACKAGE.rglob("*.py")):
            if "__pycache__" not in src.parts:
                zf.write(src, f"tessera_submit/{src.relative_to(PACKAGE).as_posix()}")
    tmp.replace(out)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "dist/tessera_submit.zip")))
