"""GPU backends: the worker's best or the job's choice; never a silent fall back to the CPU."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from farm.errors import DeviceUnavailable
from tests.blendscenes import make_scene
from workers import exr
from workers.backends import choose_backend
from workers.child import BlenderChild


def test_the_best_backend_with_a_device_wins() -> None:
    found = {"OPTIX": 1, "CUDA": 1, "HIP": 0, "ONEAPI": None, "METAL": None}
    assert choose_backend(found) == ("OPTIX", [])
    assert choose_backend({**found, "OPTIX": 0}) == ("CUDA", ["OPTIX: no devices"])
    assert choose_backend({"OPTIX": None, "CUDA": 0, "HIP": 2}) == (
        "HIP",
        ["OPTIX: not supported by this Blender build", "CUDA: no devices"],
    )


def test_an_asked_backend_is_the_only_one_taken() -> None:
    found = {"OPTIX": 1, "CUDA": 1, "HIP": 0}
    assert choose_backend(found, "cuda") == ("CUDA", [])
    assert choose_backend(found, "HIP") == (None, ["HIP: no devices"])
    assert choose_backend({}, "ONEAPI") == (None, ["ONEAPI: not supported by this Blender build"])


@pytest.fixture(scope="module")
def gpu_child(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BlenderChild]:
    """A Blender child told to render on a GPU, on a machine that has none."""
    with BlenderChild(
        python=sys.executable, work_dir=tmp_path_factory.mktemp("gpu"), device="gpu", name="gpu"
    ) as child:
        if child.device_error is None:
            pytest.skip(f"this machine has a GPU ({child.device_name}): nothing to fall back from")
        yield child


def test_a_gpu_tile_without_its_gpu_fails_with_the_reason_or_falls_back_when_allowed(
    gpu_child: BlenderChild, tmp_path: Path
) -> None:
    blend = make_scene(tmp_path / "s.blend", width=32, height=24, samples=2)

    def render(name: str, **options: object) -> dict[str, object]:
        return gpu_child.render(blend, frame=1, width=32, height=24, rect=None, samples=None,
                                out_path=tmp_path / name, timeout_s=60,
                                options=dict(options))  # fmt: skip

    with pytest.raises(DeviceUnavailable, match=r"no GPU for Cycles \(OPTIX: .*CUDA: "):
        render("a.exr", backend="OPTIX")
    assert not (tmp_path / "a.exr").exists()
    result = render("b.exr", backend="OPTIX", allow_cpu_fallback=True)
    assert result["device"] == "CPU"
    assert "no GPU for Cycles" in str(result["fallback"])
    with BlenderChild(python=sys.executable, work_dir=tmp_path / "cpu", name="cpu") as cpu:
        cpu.render(blend, frame=1, width=32, height=24, rect=None, samples=None,
                   out_path=tmp_path / "c.exr", timeout_s=60)  # fmt: skip
    assert np.array_equal(exr.read_rgba(tmp_path / "b.exr"), exr.read_rgba(tmp_path / "c.exr"))
