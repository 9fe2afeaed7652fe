"""Choosing the Cycles GPU backend: the job's, or the best one the device offers."""

from __future__ import annotations

from collections.abc import Mapping

from farm.settings import GPU_BACKENDS


def choose_backend(
    found: Mapping[str, int | None], asked: str | None = None
) -> tuple[str | None, list[str]]:
    """The backend to render with, and why each better one was not taken.

    ``found`` maps a backend name to the GPUs Cycles lists for it (``refresh_devices``), or to
    None when this Blender build does not support it. With ``asked`` only that backend will do;
    otherwise the first with a GPU in the preference order OPTIX > CUDA > HIP > ONEAPI > METAL
    (OptiX and CUDA drive the same NVIDIA cards; OptiX renders faster there).
    """
    wanted = [asked.upper()] if asked else list(GPU_BACKENDS)
    reasons: list[str] = []
    for name in wanted:
        count = found.get(name)
        if count is None:
            reasons.append(f"{name}: not supported by this Blender build")
        elif count < 1:
            reasons.append(f"{name}: no devices")
        else:
            return name, reasons
    return None, reasons
