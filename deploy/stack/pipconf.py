"""The host's pip configuration as an image build secret: pip.conf, the CA bundle, local paths.

An image build must reach the package index the host reaches (a proxy with its own CA, a
private index, local wheel folders) without writing any of it into a layer. This reads what
the host's pip would use (``pip config list``: files and ``PIP_*`` variables, plus the CA
variables requests honours), and writes into OUT_DIR:

  pip.conf   index-url, extra-index-url, find-links, trusted-host, timeout; ``cert`` pointing at
             /run/secrets/ca.crt when the host names a CA bundle
  ca.crt     a copy of that bundle (absent when the host names none)
  volumes    one local folder per line that file:// indexes and find-links name, to bind
             read-only into the build at the same path

Usage: python pipconf.py OUT_DIR
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

#: pip options passed on (others, such as a constraint file on the host, are the host's own)
PASSED = ("index-url", "extra-index-url", "find-links", "trusted-host", "default-timeout")
#: where the build sees the CA bundle (the secret's mount point)
SECRET_CA = "/run/secrets/ca.crt"
#: variables that name a CA bundle when pip's own ``cert`` is not set
CA_VARIABLES = ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "CURL_CA_BUNDLE")


def host_pip_options() -> dict[str, str]:
    """``pip config list`` as option -> value; environment entries win over files."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in out.splitlines():
        key, _, quoted = line.partition("=")
        section, _, option = key.rpartition(".")
        value = quoted.strip().strip("'\"")
        (env if section == ":env:" else files)[option] = value
    return {**files, **env}


def local_folder(location: str) -> Path | None:
    """The folder a find-links or index entry reads on this machine, if it is local."""
    parts = urlsplit(location)
    if parts.scheme == "file":
        path = Path(parts.path)
    elif not parts.scheme and location.startswith("/"):
        path = Path(location)
    else:
        return None
    # an index URL names .../simple; bind its parent, where the files usually sit beside it
    return path.parent if path.name == "simple" else path


def main(out_dir: Path) -> None:
    options = host_pip_options()
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["[global]"]
    volumes: set[Path] = set()
    for option in PASSED:
        if option not in options:
            continue
        lines.append(f"{option} = {options[option]}")
        if option in ("index-url", "extra-index-url", "find-links"):
            for location in options[option].split():
                folder = local_folder(location)
                if folder is not None and folder.is_dir():
                    volumes.add(folder)
    ca = options.get("cert") or next((os.environ[v] for v in CA_VARIABLES if v in os.environ), "")
    ca_out = out_dir / "ca.crt"
    ca_out.unlink(missing_ok=True)
    if ca and Path(ca).is_file():
        shutil.copyfile(ca, ca_out)
        lines.append(f"cert = {SECRET_CA}")
    conf = out_dir / "pip.conf"
    conf.write_text("\n".join(lines) + "\n")
    for path in (conf, ca_out):
        if path.exists():
            path.chmod(0o600)
    (out_dir / "volumes").write_text("".join(f"{v}\n" for v in sorted(volumes)))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
