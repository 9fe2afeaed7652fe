"""Which NVML FARM_NVML names: the driver's (real), none where there is no driver (auto), or
the fake."""

from __future__ import annotations

import logging

from farm.errors import BadParameter, NvmlError
from farm.gpu.real import NO_DRIVER_CODES, RealNvml
from farm.gpu.types import Nvml

log = logging.getLogger("tessera.nvml")


def open_nvml(spec: str) -> Nvml | None:
    """The NVML that FARM_NVML names: ``auto``, ``real`` or ``fake:MODEL[,MODEL...]``.

    ``auto`` answers None where NVML cannot start (no NVIDIA driver): the caller then offers a
    CPU device. ``real`` raises ``NvmlError`` instead.
    """
    if spec.startswith("fake:"):
        # imported here: the fake is for tests and demos, never loaded on a production path
        from farm.gpu.fake import FakeNvml

        return FakeNvml([model for model in spec.removeprefix("fake:").split(",") if model])
    if spec == "real":
        try:
            return RealNvml()
        except NvmlError as err:
            raise NvmlError(
                f"FARM_NVML=real but NVML could not start ({err.message}); install the NVIDIA "
                "driver (nvidia-smi must list the GPUs) or set FARM_NVML=auto",
                **err.fields,
            ) from err
    if spec == "auto":
        try:
            return RealNvml()
        except NvmlError as err:
            broken = err.fields.get("nvml_code") not in NO_DRIVER_CODES
            log.log(
                logging.WARNING if broken else logging.INFO,
                "event=nvml_unavailable reason=%r devices=cpu",
                err.message,
            )
            return None
    raise BadParameter(f"FARM_NVML {spec!r} is not auto, real or fake:MODEL[,MODEL...]")
