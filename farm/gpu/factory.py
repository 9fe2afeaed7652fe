"""Which NVML FARM_NVML names: the driver's (real), or none where there is no driver (auto); and
the test doubles a test entry point may install in their place."""

from __future__ import annotations

import logging
from collections.abc import Callable

from farm.errors import BadParameter, NvmlError
from farm.gpu.real import NO_DRIVER_CODES, RealNvml
from farm.gpu.types import Nvml
from farm.settings import NVML_MODES

log = logging.getLogger("tessera.nvml")

#: FARM_NVML schemes of test doubles (``fake`` for ``fake:t4,l4``), each making an Nvml from the
#: text after the colon; only the test suite's entry point (tests/doubles.py) installs one, so a
#: production process knows auto and real alone and never loads a fake
_DOUBLES: dict[str, Callable[[str], Nvml]] = {}


def install_double(scheme: str, make: Callable[[str], Nvml]) -> None:
    """Let FARM_NVML be ``SCHEME:ARGS``, opened as ``make(ARGS)`` (test entry points only)."""
    _DOUBLES[scheme] = make


def remove_double(scheme: str) -> None:
    _DOUBLES.pop(scheme, None)


def check_spec(spec: str) -> None:
    """BadParameter unless FARM_NVML ``spec`` is auto, real or an installed double's scheme."""
    scheme, colon, _args = spec.partition(":")
    if spec in NVML_MODES or (colon and scheme in _DOUBLES):
        return
    allowed = [*NVML_MODES, *(f"{name}:..." for name in sorted(_DOUBLES))]
    raise BadParameter(f"FARM_NVML {spec!r} is not one of {', '.join(allowed)}")


def open_nvml(spec: str) -> Nvml | None:
    """The NVML that FARM_NVML names: ``auto`` or ``real`` (or an installed double's scheme).

    ``auto`` answers None where NVML cannot start (no NVIDIA driver): the caller then offers a
    CPU device. ``real`` raises ``NvmlError`` instead.
    """
    check_spec(spec)
    scheme, colon, args = spec.partition(":")
    if colon:
        return _DOUBLES[scheme](args)
    if spec == "real":
        try:
            return RealNvml()
        except NvmlError as err:
            raise NvmlError(
                f"FARM_NVML=real but NVML could not start ({err.message}); install the NVIDIA "
                "driver (nvidia-smi must list the GPUs) or set FARM_NVML=auto",
                **err.fields,
            ) from err
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
