"""Frame lists: parse "1-10,20,30-40x2" into the ordered frames a job renders."""

from __future__ import annotations

import re

from farm.errors import BadFrameList

#: Blender's frame limits (MINAFRAME .. MAXFRAME)
MIN_FRAME = -1_048_574
MAX_FRAME = 1_048_574
#: the most frames one job may ask for
MAX_FRAMES = 100_000

_PART = re.compile(r"(-?\d+)(?:\s*(?:-|\.\.)\s*(-?\d+)(?:\s*[xX:]\s*(\d+))?)?")


def parse_frames(text: str) -> list[int]:
    """Frames in the order given, duplicates dropped.

    Parts are separated by commas: ``N``, ``A-B`` (inclusive) and ``A-BxS`` (every S-th frame
    from A to B). ``A..B`` is accepted for ranges with negative frames (``-5..5``).
    """
    if not text or not text.strip():
        raise BadFrameList("the frame list is empty; give frames like 1-10,20", frames=text)
    frames: list[int] = []
    seen: set[int] = set()
    for raw in text.split(","):
        part = raw.strip()
        m = _PART.fullmatch(part)
        if not part or not m:
            raise BadFrameList(
                f"frame list part {part!r} is not N, A-B or A-BxSTEP", frames=text, part=part
            )
        start = int(m.group(1))
        end = int(m.group(2)) if m.group(2) is not None else start
        step = int(m.group(3)) if m.group(3) is not None else 1
        if step < 1:
            raise BadFrameList(f"frame step in {part!r} must be 1 or more", frames=text, part=part)
        if end < start:
            raise BadFrameList(
                f"frame range {part!r} ends before it starts", frames=text, part=part
            )
        for f in (start, end):
            if not MIN_FRAME <= f <= MAX_FRAME:
                raise BadFrameList(
                    f"frame {f} is outside Blender's range {MIN_FRAME}..{MAX_FRAME}",
                    frames=text,
                )
        # checked per part before building it, so a huge range is refused without being built
        if (end - start) // step + 1 > MAX_FRAMES:
            raise BadFrameList(f"more than {MAX_FRAMES} frames in one job", frames=text)
        for f in range(start, end + 1, step):
            if f not in seen:
                seen.add(f)
                frames.append(f)
        if len(frames) > MAX_FRAMES:
            raise BadFrameList(f"more than {MAX_FRAMES} frames in one job", frames=text)
    return frames


def format_frames(frames: list[int]) -> str:
    """The shortest list of ``N`` and ``A-B`` parts for ``frames`` (for display)."""
    if not frames:
        return ""
    parts: list[str] = []
    ordered = sorted(set(frames))
    start = prev = ordered[0]
    for f in [*ordered[1:], None]:
        if f is not None and f == prev + 1:
            prev = f
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if f is not None:
            start = prev = f
    return ",".join(parts)


#: the orders a job's frames may be queued in: as listed, or its first, last and middle frames
#: first (problems show early: Blender Studio's job type does this), then the rest as listed
FRAME_ORDERS = ("sequential", "first-last-middle")


def ordered_frames(frames: list[int] | tuple[int, ...], order: str) -> list[int]:
    """``frames`` in the order their tiles are queued."""
    frames = list(frames)
    if order != "first-last-middle" or len(frames) < 3:
        return frames
    first = [frames[0], frames[-1], frames[len(frames) // 2]]
    head = list(dict.fromkeys(first))
    return head + [f for f in frames if f not in set(head)]
