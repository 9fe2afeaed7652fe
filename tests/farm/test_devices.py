"""Tests of the host's device inventory: GPUs from (fake) NVML, the CPU device, overrides."""

from __future__ import annotations

import json

import pytest

from farm.alloc.devices import (
    CONSUMER_NVENC_SESSION_CAP,
    Device,
    device_class_of,
    host_devices,
    host_encoder_budget,
)
from farm.errors import BadParameter, NvmlError
from farm.gpu.fake import FakeNvml
from farm.settings import Settings

DEFAULTS = Settings()


def inventory(models: list[str], settings: Settings = DEFAULTS) -> list[Device]:
    return host_devices(settings, FakeNvml(models), hostname="render-7")


@pytest.mark.parametrize(
    ("model", "device_class", "vram_mib", "sessions"),
    [
        ("t4", "t4", 15360, 8),
        ("l4", "l4", 23034, 16),
        ("a10", "a10", 23028, 8),
        ("l40s", "l40s", 46068, 24),
        ("a100", "a100", 81920, 0),
        ("h100", "h100", 81559, 0),
        ("h200", "h200", 143771, 0),
        ("rtx4090", "rtx4090", 24564, 16),
    ],
)
def test_each_gpu_model_becomes_a_device(
    model: str, device_class: str, vram_mib: int, sessions: int
) -> None:
    (device,) = inventory([model])
    assert device.device_class == device_class
    assert device.vram_mib == vram_mib
    assert device.encoder_sessions == sessions
    # a GPU without NVENC still renders
    assert device.render_slots == DEFAULTS.gpu_render_slots == 2
    assert device.id == f"GPU-fake-{model}-0"
    assert device.host == "render-7" and device.index == 0
    assert ("nvenc" in device.labels) is (sessions > 0)
    assert device.consumer is (model == "rtx4090")


def test_two_l4s_are_two_devices() -> None:
    devices = inventory(["2xl4"])
    assert [d.index for d in devices] == [0, 1]
    assert [d.encoder_sessions for d in devices] == [16, 16]
    assert devices[0].id != devices[1].id


def test_sessions_per_engine_and_render_slots_come_from_settings() -> None:
    settings = Settings(encoder_sessions_per_engine=4, gpu_render_slots=3)
    (t4, l4) = inventory(["t4", "l4"], settings)
    assert (t4.encoder_sessions, l4.encoder_sessions) == (4, 8)
    assert t4.render_slots == l4.render_slots == 3


def test_no_nvml_means_one_cpu_device_sized_from_the_cores() -> None:
    (cpu,) = host_devices(DEFAULTS, None, hostname="laptop", cpu_count=16, memory_mib=65536)
    assert cpu.id == "cpu-laptop" and cpu.device_class == "cpu" and cpu.index is None
    assert (cpu.render_slots, cpu.encoder_sessions) == (8, 8)
    assert cpu.vram_mib == 65536
    assert not cpu.consumer


def test_cpu_device_has_at_least_one_slot_and_honours_settings() -> None:
    (small,) = host_devices(DEFAULTS, None, hostname="h", cpu_count=1, memory_mib=2048)
    assert (small.render_slots, small.encoder_sessions) == (1, 1)
    settings = Settings(cpu_render_slots=3, cpu_encode_sessions=5)
    (cpu,) = host_devices(settings, None, hostname="h", cpu_count=64, memory_mib=2048)
    assert (cpu.render_slots, cpu.encoder_sessions) == (3, 5)


def test_cpu_device_defaults_come_from_this_machine() -> None:
    (cpu,) = host_devices(DEFAULTS, None)
    assert cpu.render_slots >= 1 and cpu.encoder_sessions >= 1
    assert cpu.vram_mib > 0 and cpu.model


def test_driver_without_gpus_offers_the_cpu() -> None:
    (cpu,) = host_devices(DEFAULTS, FakeNvml([]), hostname="h", cpu_count=4, memory_mib=1024)
    assert cpu.device_class == "cpu"


def test_a_lost_gpu_is_an_error_not_a_smaller_inventory() -> None:
    nvml = FakeNvml(["t4", "t4"])
    nvml.lose(1)
    with pytest.raises(NvmlError) as caught:
        host_devices(DEFAULTS, nvml, hostname="h")
    assert caught.value.fields["lost"] is True


@pytest.mark.parametrize(
    ("name", "device_class"),
    [
        ("Tesla T4", "t4"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada-generation"),
        ("Tesla V100-SXM2-16GB", "v100-sxm2-16gb"),
        ("NVIDIA", "gpu"),
    ],
)
def test_device_class_of(name: str, device_class: str) -> None:
    assert device_class_of(name) == device_class


# --- overrides -------------------------------------------------------------------------------


def with_overrides(overrides: object) -> Settings:
    return Settings(device_overrides=json.dumps(overrides))


def test_override_by_class_applies_to_every_gpu_of_it() -> None:
    settings = with_overrides({"l4": {"encoder_sessions": 10, "labels": ["edge"]}})
    l4a, l4b, t4 = inventory(["2xl4", "t4"], settings)
    assert l4a.encoder_sessions == l4b.encoder_sessions == 10
    assert l4a.labels == ("edge",)
    assert t4.encoder_sessions == 8


def test_override_by_model_name_and_uuid_the_most_specific_wins() -> None:
    settings = with_overrides(
        {
            "t4": {"render_slots": 1, "encoder_sessions": 4},
            "Tesla T4": {"render_slots": 5},
            "GPU-fake-t4-1": {"render_slots": 0, "vram_mib": 8000, "device_class": "t4-half"},
        }
    )
    first, second = inventory(["2xt4"], settings)
    assert (first.render_slots, first.encoder_sessions, first.vram_mib) == (5, 4, 15360)
    assert (second.render_slots, second.encoder_sessions, second.vram_mib) == (0, 4, 8000)
    assert second.device_class == "t4-half"


def test_override_of_the_cpu_device() -> None:
    settings = with_overrides({"cpu": {"render_slots": 2, "encoder_sessions": 0}})
    (cpu,) = host_devices(settings, None, hostname="h", cpu_count=32, memory_mib=1024)
    assert (cpu.render_slots, cpu.encoder_sessions) == (2, 0)


def test_override_for_devices_this_host_lacks_is_ignored() -> None:
    settings = with_overrides({"h100": {"render_slots": 8}})
    assert inventory(["t4"], settings) == inventory(["t4"])


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{not json", ["FARM_DEVICE_OVERRIDES", "JSON"]),
        ("[1, 2]", ["FARM_DEVICE_OVERRIDES", "object"]),
        ('{"t4": 3}', ["'t4'", "object"]),
        ('{"t4": {"vram": 100}}', ["vram", "vram_mib"]),
        ('{"t4": {"render_slots": -1}}', ["render_slots"]),
        ('{"t4": {"render_slots": true}}', ["render_slots"]),
        ('{"t4": {"encoder_sessions": 1.5}}', ["encoder_sessions"]),
        ('{"t4": {"device_class": ""}}', ["device_class"]),
        ('{"t4": {"labels": "gpu"}}', ["labels"]),
    ],
)
def test_bad_overrides_are_refused_with_the_reason(text: str, words: list[str]) -> None:
    with pytest.raises(BadParameter) as caught:
        inventory(["t4"], Settings(device_overrides=text))
    for word in words:
        assert word in caught.value.message


# --- the host's NVENC budget -------------------------------------------------------------------


def test_consumer_card_gets_the_drivers_cap() -> None:
    devices = inventory(["rtx4090", "rtx4090"])
    assert sum(d.encoder_sessions for d in devices) == 32
    assert host_encoder_budget(DEFAULTS, devices) == CONSUMER_NVENC_SESSION_CAP == 8


def test_data_centre_cards_have_no_cap() -> None:
    assert host_encoder_budget(DEFAULTS, inventory(["l4", "t4"])) is None
    cpu = host_devices(DEFAULTS, None, hostname="h", cpu_count=4, memory_mib=1024)
    assert host_encoder_budget(DEFAULTS, cpu) is None


def test_configured_budget_wins() -> None:
    settings = Settings(host_encoder_budget=5)
    assert host_encoder_budget(settings, inventory(["rtx4090"])) == 5
    assert host_encoder_budget(settings, inventory(["l4"])) == 5
