"""The test suite's doubles for what a CPU machine lacks (NVML, NVENC), and its entry point:
``python -m tests.doubles ARGS`` is ``farm ARGS`` with FARM_NVML=fake:... and FARM_NVENC=fake
allowed. Production never installs them: there FARM_NVML is auto|real, FARM_NVENC auto|require|off.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from av.video.codeccontext import VideoCodecContext

from encoder import videoencoder
from encoder.videoencoder import NvencEncoder
from farm.gpu import factory
from farm.gpu.fake import FakeNvml

#: FARM_NVML=fake:t4,2xl4 is a FakeNvml of those models (farm/gpu/fake.py: FAKE_MODELS)
NVML_SCHEME = "fake"
#: FARM_NVENC=fake is FakeNvencEncoder
NVENC_MODE = "fake"


class FakeNvencEncoder(NvencEncoder):
    """The NVENC path (options, selection, accounting, reporting) over libx264, for machines
    without NVENC: a session reports h264_nvenc, its options are NVENC's."""

    backend = "libx264"
    formats: tuple[str, ...] = ("yuv420p",)

    def _open(self, codec: str, options: dict[str, str]) -> VideoCodecContext:
        # the NVENC options are built and kept (self.options); libx264 gets its own
        underneath = {
            "preset": "ultrafast",
            "tune": "zerolatency",
            "forced-idr": options["forced-idr"],
            "maxrate": options["maxrate"],
            "bufsize": options["bufsize"],
        }
        return super()._open(codec, underneath)


def fake_nvml(models: str) -> FakeNvml:
    """The FakeNvml FARM_NVML=fake:MODELS names (``t4,2xl4``)."""
    return FakeNvml([model for model in models.split(",") if model])


def install() -> None:
    """Allow FARM_NVML=fake:MODELS and FARM_NVENC=fake in this process."""
    factory.install_double(NVML_SCHEME, fake_nvml)
    videoencoder.install_double(NVENC_MODE, FakeNvencEncoder)


def uninstall() -> None:
    factory.remove_double(NVML_SCHEME)
    videoencoder.remove_double(NVENC_MODE)


@contextmanager
def removed() -> Iterator[None]:
    """This process as production sees it (no doubles) for the block; installed again after."""
    uninstall()
    try:
        yield
    finally:
        install()


def main() -> int:
    from farm.cli import main as farm_main

    install()
    return farm_main()


if __name__ == "__main__":
    raise SystemExit(main())
