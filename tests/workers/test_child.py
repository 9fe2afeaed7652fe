"""The Blender child with real bpy renders: exact tiles, kept-open files, inspection, failures."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image

from farm.errors import (
    BadBlendFile,
    BadParameter,
    BlenderCrashed,
    DeviceUnavailable,
    NoCamera,
    TileAbandoned,
    TileTimeout,
)
from farm.tiling import Rect, TileGrid, plan_tiles
from tests.blendscenes import make_scene, render_reference
from tests.conftest import TESTDATA
from workers import wire
from workers.child import BlenderChild
from workers.exr import read_rgba
from workers.stitching import stitch

W, H = 67, 41
#: far more samples than a test can wait for: a render that is still running when we act
ENDLESS_SAMPLES = 10_000_000
TIMEOUT_S = 60.0


def _new_child(work_dir: Path, **kwargs: Any) -> BlenderChild:
    return BlenderChild(python=sys.executable, work_dir=work_dir, **kwargs)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("child")


@pytest.fixture(scope="module")
def child(work: Path) -> Iterator[BlenderChild]:
    with _new_child(work / "logs") as c:
        yield c


@pytest.fixture(scope="module")
def scene(work: Path) -> Path:
    return make_scene(work / "plain.blend", width=W, height=H, samples=8, frame_end=2)


@pytest.fixture(scope="module")
def full_frame(child: BlenderChild, scene: Path, work: Path) -> npt.NDArray[np.float32]:
    out = work / "full.exr"
    reply = child.render(
        scene, frame=1, width=W, height=H, rect=None, samples=None, out_path=out,
        timeout_s=TIMEOUT_S,
    )  # fmt: skip
    assert (reply["width"], reply["height"]) == (W, H)
    return read_rgba(out)


def _render_tiles(
    child: BlenderChild, blend: Path, out_dir: Path, grid: TileGrid, overlap_px: int
) -> npt.NDArray[np.float32]:
    tiles = []
    for plan in plan_tiles(W, H, grid, overlap_px):
        out = out_dir / f"{grid}-{overlap_px}-{plan.index}.exr"
        reply = child.render(
            blend, frame=1, width=W, height=H, rect=plan.render, samples=None, out_path=out,
            timeout_s=TIMEOUT_S,
        )  # fmt: skip
        assert (reply["width"], reply["height"]) == (plan.render.width, plan.render.height)
        tiles.append((plan, read_rgba(out)))
    return stitch(W, H, tiles)


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> None:
    """Poll for an outside event (a log line) until it happens or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"event did not happen within {timeout_s} s")
        threading.Event().wait(0.01)


# --- rendering ---------------------------------------------------------------------------------


def test_full_frame_is_float_rgba_exr(full_frame: npt.NDArray[np.float32]) -> None:
    assert full_frame.shape == (H, W, 4)
    assert full_frame.dtype == np.float32
    assert np.all(full_frame[..., 3] == 1.0)
    # a lit scene, not a black or magenta frame
    assert 0.02 < float(full_frame[..., :3].mean()) < 5.0


@pytest.mark.parametrize("grid", ["1x1", "2x2", "3x3"])
def test_tiles_stitch_into_the_full_frame_bit_for_bit(
    child: BlenderChild, scene: Path, work: Path, full_frame: npt.NDArray[np.float32], grid: str
) -> None:
    stitched = _render_tiles(child, scene, work, TileGrid.parse(grid), overlap_px=0)
    assert np.array_equal(stitched, full_frame)


@pytest.fixture(scope="module")
def adaptive_scene(work: Path) -> Path:
    # Enough samples for adaptive sampling to stop some pixels early (8 do not).
    return make_scene(work / "adaptive.blend", width=W, height=H, samples=256, adaptive=True)


@pytest.mark.parametrize("grid", ["2x2", "3x3"])
def test_adaptive_tiles_with_overlap_stitch_bit_for_bit(
    child: BlenderChild, adaptive_scene: Path, work: Path, grid: str
) -> None:
    out = work / "adaptive-full.exr"
    child.render(
        adaptive_scene, frame=1, width=W, height=H, rect=None, samples=None, out_path=out,
        timeout_s=TIMEOUT_S,
    )  # fmt: skip
    stitched = _render_tiles(child, adaptive_scene, work, TileGrid.parse(grid), overlap_px=16)
    assert np.array_equal(stitched, read_rgba(out))


def test_file_stays_open_between_tiles(child: BlenderChild, scene: Path) -> None:
    child.open(scene, TIMEOUT_S)
    assert child.open(scene, TIMEOUT_S)["reused"] is True
    # a new upload at the same path is a different file
    st = scene.stat()
    os.utime(scene, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert child.open(scene, TIMEOUT_S)["reused"] is False
    assert child.open(scene, TIMEOUT_S)["reused"] is True


def test_samples_and_frame_changes_reach_a_kept_open_file(
    child: BlenderChild, scene: Path, work: Path
) -> None:
    # One child renders a sequence on the kept-open file; fresh children (with one fixed
    # thread, which must not change pixels) render the same requests from scratch.
    requests = [(1, 4), (1, 64), (2, 64), (2, 4)]
    kept = []
    for frame, samples in requests:
        out = work / f"kept-{frame}-{samples}.exr"
        child.render(
            scene, frame=frame, width=W, height=H, rect=None, samples=samples, out_path=out,
            timeout_s=TIMEOUT_S,
        )  # fmt: skip
        kept.append(read_rgba(out))
    assert not np.array_equal(kept[0], kept[1]), "a samples change was ignored"
    assert not np.array_equal(kept[1], kept[2]), "frames 1 and 2 should differ"
    with _new_child(work / "logs", threads=1) as fresh:
        for (frame, samples), pixels in zip(requests[1:3], kept[1:3], strict=True):
            out = work / f"fresh-{frame}-{samples}.exr"
            fresh.render(
                scene, frame=frame, width=W, height=H, rect=None, samples=samples,
                out_path=out, timeout_s=TIMEOUT_S,
            )  # fmt: skip
            assert np.array_equal(read_rgba(out), pixels)


def test_tile_outside_the_frame_is_refused_and_child_serves_on(
    child: BlenderChild, scene: Path, work: Path
) -> None:
    pid = child.pid
    with pytest.raises(BadParameter, match="not inside"):
        child.render(
            scene, frame=1, width=W, height=H, rect=Rect(0, 0, W + 1, H), samples=None,
            out_path=work / "never.exr", timeout_s=TIMEOUT_S,
        )  # fmt: skip
    assert not (work / "never.exr").exists()
    assert child.ping()["pid"] == pid


# --- scripts stay off --------------------------------------------------------------------------


def test_scripts_in_the_file_never_run(child: BlenderChild, work: Path) -> None:
    autorun, driver = work / "autorun-ran.txt", work / "driver-ran.txt"
    blend = make_scene(work / "scripts.blend", autorun_canary=autorun, driver_canary=driver)
    report = child.inspect(blend, TIMEOUT_S)
    reply = child.render(
        blend, frame=1, width=W, height=H, rect=None, samples=2,
        out_path=work / "scripts.exr", timeout_s=TIMEOUT_S,
    )  # fmt: skip
    assert not autorun.exists()
    assert not driver.exists()
    assert report["autoexec_fail"] is True
    assert report["autoexec_fail_message"]
    assert report["wants_scripts"] is True
    assert "text 'canary.py' is registered to run on load" in report["scripts"]
    drivers = [s for s in report["scripts"] if s.startswith("driver on Cube location[2]: ")]
    assert len(drivers) == 1 and "driver-ran.txt" in drivers[0]
    assert reply["autoexec_fail"] is True


# --- inspection --------------------------------------------------------------------------------


def test_inspect_reports_a_generated_scene(child: BlenderChild, work: Path) -> None:
    blend = make_scene(
        work / "inspect" / "scene.blend", width=50, height=30, samples=12, frame_end=5,
        adaptive=True, camera=False, missing_texture=True,
    )  # fmt: skip
    report = child.inspect(blend, TIMEOUT_S)
    assert 300 <= report.pop("vram_estimate_mib") < 400
    assert report == {
        "path": str(blend),
        "version": "5.0",
        "scene": "Scene",
        "engine": "CYCLES",
        "frame_start": 1,
        "frame_end": 5,
        "frame_step": 1,
        "fps": 24.0,
        "width": 50,
        "height": 30,
        "samples": 12,
        "adaptive_sampling": True,
        "denoising": True,
        "cameras": [],
        "camera": None,
        "missing_files": ["//textures/missing_texture.png"],
        "libraries": [],
        "autoexec_fail": False,
        "autoexec_fail_message": "",
        "wants_scripts": False,
        "scripts": [],
    }
    with pytest.raises(NoCamera, match="has no camera"):
        child.render(
            blend, frame=1, width=50, height=30, rect=None, samples=1,
            out_path=work / "inspect" / "never.exr", timeout_s=TIMEOUT_S,
        )  # fmt: skip


def test_inspect_is_not_changed_by_earlier_renders(
    child: BlenderChild, scene: Path, full_frame: npt.NDArray[np.float32]
) -> None:
    child.render(
        scene, frame=1, width=20, height=10, rect=Rect(0, 0, 10, 10), samples=3,
        out_path=scene.with_name("small.exr"), timeout_s=TIMEOUT_S,
    )  # fmt: skip
    report = child.inspect(scene, TIMEOUT_S)
    assert (report["width"], report["height"], report["samples"]) == (W, H, 8)
    assert report["denoising"] is True


def test_missing_library_is_reported(child: BlenderChild, work: Path) -> None:
    # beside the scene: inside its file set (one outside is missing whether it exists or not)
    library = make_scene(work / "linking" / "lib" / "library.blend")
    blend = make_scene(work / "linking" / "linking.blend", linked_library=library)
    assert child.inspect(blend, TIMEOUT_S)["missing_files"] == []
    library.unlink()
    report = child.inspect(blend, TIMEOUT_S)
    # as written in Blender (saved relative beside the scene)
    assert report["libraries"] == ["//lib/library.blend"]
    assert "//lib/library.blend" in report["missing_files"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("01_missing_textures.blend", {"missing_files": ["//MissingTexture.png"]}),
        ("01_principled_material.blend", {"missing_files": [], "version": "2.79"}),
        (
            "12_anim_range_driver.blend",
            {"frame_start": 1, "frame_end": 10, "engine": "BLENDER_EEVEE", "version": "3.3"},
        ),
    ],
)
def test_inspect_real_files(child: BlenderChild, name: str, expected: dict[str, Any]) -> None:
    report = child.inspect(TESTDATA / name, TIMEOUT_S)
    assert {key: report[key] for key in expected} == expected
    assert report["camera"] == "Camera"


def test_unreadable_files_are_bad_blend_files(child: BlenderChild, work: Path) -> None:
    not_blend = work / "notes.blend"
    not_blend.write_text("these are not the droids you are looking for\n")
    truncated = work / "truncated.blend"
    truncated.write_bytes((TESTDATA / "01_principled_material.blend").read_bytes()[:40_000])
    pid = child.pid
    for path in (not_blend, truncated, work / "absent.blend"):
        with pytest.raises(BadBlendFile) as caught:
            child.inspect(path, TIMEOUT_S)
        # the user's file name, not where the server keeps it
        assert path.name in caught.value.message and str(path.parent) not in caught.value.message
    assert child.ping()["pid"] == pid


# --- crashes, timeouts, devices ----------------------------------------------------------------


def _render_in_thread(
    child: BlenderChild, blend: Path, out: Path
) -> tuple[threading.Thread, dict[str, BaseException]]:
    caught: dict[str, BaseException] = {}

    def run() -> None:
        try:
            child.render(
                blend, frame=1, width=W, height=H, rect=Rect(0, 0, 30, 20),
                samples=ENDLESS_SAMPLES, out_path=out, timeout_s=TIMEOUT_S,
            )  # fmt: skip
        except BaseException as exc:
            caught["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, caught


def test_crash_mid_render_is_reported_and_the_next_render_restarts(scene: Path, work: Path) -> None:
    with _new_child(work / "logs", name="crashing") as c:
        first_pid = c.pid
        assert first_pid is not None and c.log_path is not None
        log_path = c.log_path
        thread, caught = _render_in_thread(c, scene, work / "crash.exr")
        _wait_until(lambda: "event=render" in log_path.read_text(errors="replace"), 30)
        os.kill(first_pid, signal.SIGABRT)
        thread.join(30)
        error = caught.get("error")
        assert isinstance(error, BlenderCrashed)
        assert "SIGABRT, signal 6" in error.message
        assert "log" not in error.message, "the log tail is for operators and the tile log"
        assert "rendering frame 1" in error.message
        assert error.fields["signal"] == "SIGABRT"
        assert any("event=render" in line for line in error.fields["log_tail"])
        assert not Path(f"/proc/{first_pid}").exists(), "the dead child was not reaped"
        assert not (work / "crash.exr").exists()

        reply = c.render(
            scene, frame=1, width=W, height=H, rect=None, samples=None,
            out_path=work / "after-crash.exr", timeout_s=TIMEOUT_S,
        )  # fmt: skip
        assert c.pid != first_pid
        assert reply["out_path"] == str(work / "after-crash.exr")


def test_a_child_interrupted_for_good_is_not_started_again(scene: Path, work: Path) -> None:
    """A stopping worker's grace ran out (workers.shutdown): the child it interrupted stays
    down. The next request of the same task (an inspection's probe, after its inspection)
    fails at once instead of starting a child and rendering past the grace."""
    with _new_child(work / "logs", name="interrupted") as c:
        first_pid = c.pid
        assert first_pid is not None
        c.interrupt()
        _wait_until(lambda: not c.alive, 30)
        started = time.monotonic()
        with pytest.raises(TileAbandoned, match="stopping"):
            c.inspect(scene, TIMEOUT_S)
        assert time.monotonic() - started < 5
        assert not c.alive


def test_timeout_kills_the_child_and_the_next_request_restarts_it(scene: Path, work: Path) -> None:
    with _new_child(work / "logs", name="slow") as c:
        first_pid = c.pid
        with pytest.raises(TileTimeout, match=r"1\.5 s limit") as caught:
            c.render(
                scene, frame=1, width=W, height=H, rect=None, samples=ENDLESS_SAMPLES,
                out_path=work / "slow.exr", timeout_s=1.5,
            )  # fmt: skip
        assert caught.value.fields["timeout_s"] == 1.5
        assert not c.alive
        assert not Path(f"/proc/{first_pid}").exists(), "the killed child was not reaped"
        assert c.open(scene, TIMEOUT_S)["reused"] is False
        assert c.pid != first_pid


def test_an_unreadable_request_ends_the_child_and_the_next_request_restarts_it(
    scene: Path, work: Path
) -> None:
    with _new_child(work / "logs", name="corrupt") as c:
        first_pid = c.pid
        assert c._cmd_fd is not None
        # a header announcing more than any message may hold: the child must not wait for it
        os.write(c._cmd_fd, wire.HEADER.pack(wire.MAX_MESSAGE_BYTES + 1))
        with pytest.raises(BlenderCrashed, match="exited with status 1") as caught:
            c.ping(timeout_s=TIMEOUT_S)
        assert any("event=wire_error" in line for line in caught.value.fields["log_tail"])
        assert c.open(scene, TIMEOUT_S)["reused"] is False
        assert c.pid != first_pid


def test_gpu_on_a_machine_without_one_is_device_unavailable(scene: Path, work: Path) -> None:
    with _new_child(work / "logs", device="gpu", name="gpu") as c:
        with pytest.raises(DeviceUnavailable) as caught:
            c.render(
                scene, frame=1, width=W, height=H, rect=None, samples=1,
                out_path=work / "gpu.exr", timeout_s=TIMEOUT_S,
            )  # fmt: skip
        assert "no GPU" in caught.value.message and "CUDA" in caught.value.message
        assert c.device_name is None
        assert not (work / "gpu.exr").exists()
        # the child stays up for work that needs no device
        assert c.inspect(scene, TIMEOUT_S)["width"] == W


def test_child_dies_with_its_parent(work: Path) -> None:
    parent_code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from workers.child import BlenderChild\n"
        f"c = BlenderChild(python=sys.executable, work_dir=Path({str(work / 'logs')!r}))\n"
        "c.start()\n"
        "print(c.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
    )  # fmt: skip
    assert parent.stdout is not None and parent.stdin is not None
    blender_pid = int(parent.stdout.readline())
    pidfd = os.pidfd_open(blender_pid)
    try:
        parent.kill()
        parent.wait()
        readable, _, _ = select.select([pidfd], [], [], 30)
        assert readable, "the Blender child outlived its parent"
    finally:
        os.close(pidfd)
        parent.stdin.close()
        parent.stdout.close()


#: a switch that waited for the old child to quit would wait BlenderChild.stop's 5 s for one
#: that does not answer; killing it takes milliseconds
SWITCH_BOUND_S = 2.0


def test_a_switch_to_another_file_set_kills_the_old_child_without_waiting_for_it(
    work: Path, scene: Path
) -> None:
    """The next project's task does not pay the old child's teardown, nor wait on a hung one."""
    with _new_child(work / "switch") as c:
        c.use("a", scene.parent)
        c.ping()
        old = c.pid
        assert old is not None
        os.kill(old, signal.SIGSTOP)  # a child that would never answer a request to quit
        t0 = time.monotonic()
        assert c.use("b", work / "switch")
        took = time.monotonic() - t0
        assert not c.alive and not Path(f"/proc/{old}").exists(), "the old child is gone"
        assert took < SWITCH_BOUND_S, f"the switch waited {took:.1f} s for the old child"
        c.ping()  # and the next request starts the new project's child
        assert c.pid != old


# --- delivery formats --------------------------------------------------------------------------


def test_convert_applies_the_scenes_view_transform(
    child: BlenderChild, scene: Path, work: Path, full_frame: npt.NDArray[np.float32]
) -> None:
    out = work / "convert"
    out.mkdir()
    reference_png = render_reference(scene, out / "blender.png", "PNG")
    reference_jpg = render_reference(scene, out / "blender.jpg", "JPEG", quality=90)
    outputs = [
        {"path": out / "frame.png", "format": "PNG", "color_depth": "8"},
        {"path": out / "frame16.png", "format": "PNG", "color_depth": "16"},
        {"path": out / "frame.jpg", "format": "JPEG", "quality": 90},
        {"path": out / "frame.exr", "format": "OPEN_EXR", "color_depth": "32"},
    ]
    reply = child.convert(scene, work / "full.exr", outputs, TIMEOUT_S)
    assert reply["outputs"] == [str(o["path"]) for o in outputs]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["blender.png", "blender.jpg", "frame.png", "frame16.png", "frame.jpg", "frame.exr"]
    )

    ours = np.asarray(Image.open(out / "frame.png"), dtype=np.int32)
    blenders = np.asarray(Image.open(reference_png), dtype=np.int32)
    assert ours.shape == blenders.shape == (H, W, 4)
    # Blender's dither noise (render.dither_intensity) differs by at most one level.
    assert int(np.abs(ours - blenders).max()) <= 1
    # The view transform (AgX) was applied: a plain clip of linear values looks far darker.
    plain = np.clip(full_frame[..., :3], 0.0, 1.0) * 255.0
    assert float(np.abs(ours[..., :3] - plain).mean()) > 20.0

    jpeg = np.asarray(Image.open(out / "frame.jpg"), dtype=np.int32)
    jpeg_ref = np.asarray(Image.open(reference_jpg), dtype=np.int32)
    assert jpeg.shape == (H, W, 3)
    assert float(np.abs(jpeg - jpeg_ref).mean()) < 3.0

    assert (out / "frame16.png").read_bytes()[24] == 16  # IHDR bit depth
    assert np.array_equal(read_rgba(out / "frame.exr"), full_frame)


def test_inspection_estimates_device_memory_from_the_scene(child: BlenderChild, work: Path) -> None:
    small = child.inspect(make_scene(work / "est-small.blend"), TIMEOUT_S)["vram_estimate_mib"]
    big_frame = make_scene(work / "est-big.blend", width=4000, height=4000)
    big = child.inspect(big_frame, TIMEOUT_S)["vram_estimate_mib"]
    assert 300 <= small < 400  # a device context and a tiny scene
    # 16 M pixels of render buffers at 64 bytes each
    assert big - small >= 900


def test_a_request_without_samples_renders_the_files_own_count_after_one_that_set_it(
    child: BlenderChild, scene: Path, work: Path
) -> None:
    """The child keeps a file open between requests: a count one request set must not stay
    for the next request that asks for none (the file says 8)."""
    asked = child.render(scene, frame=1, width=W, height=H, rect=Rect(0, 0, 8, 8), samples=3,
                         out_path=work / "asked.exr", timeout_s=TIMEOUT_S)  # fmt: skip
    plain = child.render(scene, frame=1, width=W, height=H, rect=Rect(0, 0, 8, 8), samples=None,
                         out_path=work / "plain.exr", timeout_s=TIMEOUT_S)  # fmt: skip
    assert (asked["samples"], plain["samples"]) == (3, 8)
