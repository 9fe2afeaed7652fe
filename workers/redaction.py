"""What of a failure a user may read: no server paths, no content hashes, no other job's id.

Blender's and Python's messages name files by their place on the worker
(``/var/lib/tessera/blends/<sha256>/files/scene.blend``). The user wrote ``scene.blend``; where
the farm keeps it, under which hash, next to which other job, is the farm's business. The full
text goes to the operator's log and the tile's own log; the message keeps the cause.
"""

from __future__ import annotations

import re

#: an absolute path: a slash-led run of path characters (quoted paths keep their quotes); not a
#: Blender-relative ``//textures/a.png``, a URL's path or a fraction
_ABSOLUTE = re.compile(r"(?<![\w/.:])/(?!/)(?:[^\s'\"/:;,()\[\]<>|]+/)*([^\s'\"/:;,()\[\]<>|]*)")
#: a sha256 (uploads are stored under it) or any longer hex run
_HASH = re.compile(r"\b[0-9a-fA-F]{40,}\b")
#: a job id, as farm.jobstore makes them: 20261201-161403-1a2b3c4d, c2-20261201-161403-1a2b3c4d
#: in a farm of cells
_JOB_ID = re.compile(r"\b(?:[a-z][a-z0-9]{0,7}-)?\d{8}-\d{6}-[0-9a-f]{8}\b")


def public(text: str, job_id: str | None = None) -> str:
    """``text`` with every absolute path cut to its file name, hashes and job ids other than
    ``job_id`` replaced by ``…``."""
    text = _ABSOLUTE.sub(lambda m: m.group(1) or "…", text)
    text = _HASH.sub("…", text)
    return _JOB_ID.sub(lambda m: m.group(0) if m.group(0) == job_id else "…", text)
