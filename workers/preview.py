"""The video preview of an animation: its frames as an H.264 MP4, written with PyAV.

The one module of the render worker that imports av (the streaming side has its own encoder in
encoder/): the worker needs only a file writer, never a stream, so it does not import encoder/.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np

from farm.errors import RenderError

#: x264 constant-quality setting: visually lossless for a review copy, small files
CRF = 18


def frame_rate(fps: float) -> Fraction:
    """``fps`` as the exact rational video rate (29.97 -> 30000/1001, 24 -> 24)."""
    if not fps > 0:
        raise RenderError(f"cannot make a video at {fps} frames per second")
    return Fraction(fps).limit_denominator(1001)


def encode_mp4(frames: Sequence[Path], fps: float, out_path: Path) -> Path:
    """Encode the 8-bit images ``frames`` (PNG or JPEG, one size) into an H.264 MP4.

    yuv420p needs even sides: an odd width or height is padded by repeating the last column or
    row, so the video shows every pixel of the frames. Written atomically (temp, rename).
    """
    # imported here, at a job's first preview: a worker imports its modules while its Blender
    # child imports bpy, and on 2 cores every millisecond of that delays the child (av and PIL
    # were about 50 ms of the worker's 300 ms; a job without a preview never needs them)
    import av
    from PIL import Image

    if not frames:
        raise RenderError("no frames to make a video of")
    out_path = Path(out_path)
    tmp = out_path.with_name(f".{out_path.name}.{uuid.uuid4().hex}.tmp.mp4")
    rate = frame_rate(fps)
    try:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=rate)
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": str(CRF), "preset": "medium"}
            size: tuple[int, int] | None = None
            for path in frames:
                with Image.open(path) as img:
                    rgb = np.asarray(img.convert("RGB"))
                if size is None:
                    size = (rgb.shape[1], rgb.shape[0])
                    stream.width = size[0] + size[0] % 2
                    stream.height = size[1] + size[1] % 2
                elif (rgb.shape[1], rgb.shape[0]) != size:
                    raise RenderError(
                        f"frame {Path(path).name} is {rgb.shape[1]}x{rgb.shape[0]}, "
                        f"not {size[0]}x{size[1]} like the first frame"
                    )
                pad = ((0, stream.height - rgb.shape[0]), (0, stream.width - rgb.shape[1]), (0, 0))
                frame = av.VideoFrame.from_ndarray(np.pad(rgb, pad, mode="edge"), format="rgb24")
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode(None):
                container.mux(packet)
        os.replace(tmp, out_path)
    except (av.FFmpegError, OSError) as exc:
        raise RenderError(f"cannot write the video {out_path.name}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return out_path
