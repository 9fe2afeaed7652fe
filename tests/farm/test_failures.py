"""A failed task's short cause, from the texts failures really come with: Blender's and the
worker's own messages (measured with bpy 5.0.1) and Cycles' out-of-memory errors."""

from __future__ import annotations

import pytest

from farm.failures import classify, shown

GPU = "GPU 0 (NVIDIA A100-SXM4-80GB)"


def cause(code: str, message: str, log_tail: tuple[str, ...] = (), **fields: object) -> str:
    return classify(code, message, fields, frame=12, device=GPU, log_tail=log_tail).cause


def test_a_missing_blend_names_the_file_not_where_the_farm_keeps_it() -> None:
    # bpy 5.0.1, wm.open_mainfile of a file that is not there, through the child's message
    opened = ('Blender cannot open shot.blend: Cannot read file '
              '"/var/lib/tessera/blends/9f2c1a7be04d3e5f6a7b8c9d0e1f2a3b4c5d6e7f8a9b0c1d2e3f4a5b6c7d8e9f/'
              'files/shot.blend": No such file or directory')  # fmt: skip
    assert cause("bad_blend_file", opened) == "missing file shot.blend"
    assert cause("render_failed", "shot.blend is not readable on worker gpu-3") == (
        "missing file shot.blend"
    )


def test_a_missing_texture_in_blenders_log_is_named() -> None:
    # Cycles' own line when an image is gone (the render itself goes on, magenta): it names
    # the cause when the render then fails without a better one
    tail = ("00:01.420  cycles           | ERROR Image file "
            "'/srv/blends/abc/textures/wood.png' does not exist.",)  # fmt: skip
    assert cause("render_failed", "Blender wrote no image for 12-0-1.exr", tail) == (
        "missing file wood.png"
    )


@pytest.mark.parametrize(
    "message",
    [
        # Cycles' CUDA device (device/cuda/device_impl.cpp) and its memory manager
        "System is out of GPU memory",
        "System is out of GPU and shared host memory",
        "CUDA error: Out of memory in cuMemAlloc_v2(&device_pointer, size) (device_impl.cpp:795)",
        "OptiX error OPTIX_ERROR_HOST_OUT_OF_MEMORY in optixDeviceContextCreate",
        "render failed: std::bad_alloc",
    ],
)
def test_out_of_memory_names_the_device_and_frame(message: str) -> None:
    assert cause("render_failed", f"render failed: {message}") == (
        f"out of memory on {GPU} in frame 12"
    )


def test_out_of_memory_found_in_blenders_log_when_the_message_says_less() -> None:
    tail = ("00:04.100  cycles           | ERROR System is out of GPU memory",)
    assert cause("render_failed", "Blender wrote no image for 12-0-1.exr", tail).startswith(
        "out of memory on GPU 0"
    )


def test_crashes_say_the_signal_and_the_frame() -> None:
    # BlenderChild._crashed's words for a SIGABRT (a 2.79 smoke domain on bpy 5.0.1)
    abort = "Blender crashed (SIGABRT, signal 6) while rendering frame 12 (full) of smoke.blend"
    assert cause("blender_crashed", abort, signal="SIGABRT") == (
        "Blender crashed (SIGABRT) in frame 12"
    )
    killed = "Blender crashed (SIGKILL, signal 9) while rendering frame 12 (full) of big.blend"
    assert cause("blender_crashed", killed, signal="SIGKILL") == (
        f"Blender was killed (SIGKILL) in frame 12, most likely out of memory on {GPU}"
    )
    exited = "Blender exited with status 1 while rendering frame 12 (full) of a.blend"
    assert cause("blender_crashed", exited, exit_code=1) == (
        "Blender exited with status 1 in frame 12"
    )


def test_a_timeout_says_the_limit() -> None:
    text = ("Blender took longer than the 0.3 s limit rendering frame 12 (tile x 0-64, y 0-40) "
            "of teapot_shot.blend; the Blender child was killed")  # fmt: skip
    assert cause("tile_timeout", text, timeout_s=0.3) == "timed out after 0.3 s in frame 12"


def test_a_corrupt_file_is_named() -> None:
    # bpy 5.0.1 on a truncated .blend
    text = ('Blender cannot open trunc.blend: Loading "trunc.blend" failed: Failed to read '
            "blend file 'trunc.blend': Missing DNA block")  # fmt: skip
    assert cause("bad_blend_file", text) == "corrupt or unreadable file trunc.blend"


def test_anything_else_keeps_its_first_sentence_and_nothing_of_the_server() -> None:
    text = "the denoiser wrote no image for frame.exr. More detail follows"
    assert cause("render_failed", text) == "the denoiser wrote no image for frame.exr"
    text = ("cannot read /srv/9f2c1a7be04d3e5f6a7b8c9d0e1f2a3b4c5d6e7f/x.blend: "
            "No such file or directory")  # fmt: skip
    hashed = cause("render_failed", text)
    assert hashed == "missing file x.blend"


def test_the_shown_reason_puts_the_cause_first() -> None:
    assert shown("timed out after 1 s in frame 3", "Blender took longer than the 1 s limit") == (
        "timed out after 1 s in frame 3 — Blender took longer than the 1 s limit"
    )
    assert shown("the scene has no camera", "the scene has no camera") == "the scene has no camera"
    # a detail that begins with its own first sentence is shown whole, never cut to it
    policy = "in project 'film' the member role may use device classes: gpu; not 'cpu'"
    assert shown(classify("forbidden", policy, frame=1, device="the CPU").cause, policy) == policy
