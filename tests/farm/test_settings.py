"""Tests of Settings.from_env: each FARM_* variable, the defaults, and what is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from farm.errors import BadParameter
from farm.settings import ENV, GPU_BACKENDS, Settings
from tests import doubles


def test_defaults_when_nothing_is_set() -> None:
    settings = Settings.from_env({})
    assert settings == Settings()
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.device == "cpu"
    assert settings.gpu_index is None and settings.gpu_backend is None
    assert settings.cpu_threads == 0
    assert settings.max_attempts == 3
    assert settings.python == sys.executable


def test_empty_values_mean_unset() -> None:
    env = {name: "" for name in ENV_VALUES}
    assert Settings.from_env(env) == Settings()


ENV_VALUES = {
    "FARM_REDIS_URL": ("redis_url", "unix:///tmp/farm/redis.sock", "unix:///tmp/farm/redis.sock"),
    "FARM_STORAGE_DIR": ("storage_dir", "/srv/storage", Path("/srv/storage")),
    "FARM_WORK_DIR": ("work_dir", "/scratch", Path("/scratch")),
    "FARM_DEVICE": ("device", "gpu", "gpu"),
    "FARM_GPU_INDEX": ("gpu_index", "3", 3),
    "FARM_GPU_BACKEND": ("gpu_backend", "CUDA", "CUDA"),
    "FARM_CPU_THREADS": ("cpu_threads", "8", 8),
    "FARM_TILE_TIMEOUT_S": ("tile_timeout_s", "90.5", 90.5),
    "FARM_INSPECT_TIMEOUT_S": ("inspect_timeout_s", "30", 30.0),
    "FARM_MAX_ATTEMPTS": ("max_attempts", "5", 5),
    "FARM_BLENDER_PYTHON": ("python", "/opt/blender/python", "/opt/blender/python"),
    "FARM_LOG_LEVEL": ("log_level", "DEBUG", "DEBUG"),
}


@pytest.mark.parametrize("name", sorted(ENV_VALUES))
def test_each_variable_is_read(name: str) -> None:
    attr, raw, value = ENV_VALUES[name]
    settings = Settings.from_env({name: raw})
    assert getattr(settings, attr) == value
    assert type(getattr(settings, attr)) is type(value)
    # nothing else changed
    assert settings == Settings().with_(**{attr: value})


def test_all_variables_together() -> None:
    settings = Settings.from_env({name: raw for name, (_, raw, _) in ENV_VALUES.items()})
    for attr, _, value in ENV_VALUES.values():
        assert getattr(settings, attr) == value


def test_unrelated_variables_are_ignored() -> None:
    assert Settings.from_env({"HOME": "/root", "FARM_UNKNOWN": "1"}) == Settings()


@pytest.mark.parametrize(
    ("name", "raw", "says"),
    [
        ("FARM_GPU_INDEX", "one", "is not a number"),
        ("FARM_GPU_INDEX", "1.5", "is not a number"),
        ("FARM_GPU_INDEX", "-1", "at least 0"),
        ("FARM_CPU_THREADS", "-2", "at least 0"),
        ("FARM_CPU_THREADS", "4 threads", "is not a number"),
        ("FARM_TILE_TIMEOUT_S", "30s", "is not a number"),
        ("FARM_TILE_TIMEOUT_S", "0.5", "at least 1"),
        ("FARM_INSPECT_TIMEOUT_S", "0", "at least 1"),
        ("FARM_MAX_ATTEMPTS", "0", "at least 1"),
        ("FARM_MAX_ATTEMPTS", "2.0", "is not a number"),
    ],
)
def test_bad_numbers_are_refused(name: str, raw: str, says: str) -> None:
    with pytest.raises(BadParameter) as raised:
        Settings.from_env({name: raw})
    assert says in raised.value.message
    assert name in raised.value.message


@pytest.mark.parametrize("raw", ["nan", "inf"])
def test_non_finite_time_limits_are_refused(raw: str) -> None:
    with pytest.raises(BadParameter):
        Settings.from_env({"FARM_TILE_TIMEOUT_S": raw})


@pytest.mark.parametrize("device", ["tpu", "GPU ", "cuda", "0"])
def test_unknown_device_is_refused(device: str) -> None:
    with pytest.raises(BadParameter) as raised:
        Settings.from_env({"FARM_DEVICE": device})
    assert "cpu, gpu" in raised.value.message


@pytest.mark.parametrize("backend", [*GPU_BACKENDS, "optix", "cuda"])
def test_known_gpu_backends_in_any_case(backend: str) -> None:
    assert Settings.from_env({"FARM_GPU_BACKEND": backend}).gpu_backend == backend.upper()


def test_unknown_gpu_backend_is_refused() -> None:
    with pytest.raises(BadParameter) as raised:
        Settings.from_env({"FARM_GPU_BACKEND": "VULKAN"})
    assert "OPTIX" in raised.value.message


@pytest.mark.parametrize(
    ("name", "raw", "allowed"),
    [("FARM_NVML", "fake:t4", "auto, real"), ("FARM_NVENC", "fake", "auto, require, off")],
)
def test_a_farm_process_refuses_the_test_doubles_naming_the_real_values(
    name: str, raw: str, allowed: str
) -> None:
    # a plain `farm` has no doubles installed (this test process has: tests/conftest.py)
    env = {key: value for key, value in os.environ.items() if not key.startswith("FARM_")}
    done = subprocess.run(
        [sys.executable, "-m", "farm", "gpus"], env={**env, name: raw},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"farm: error: {name} {raw!r} is not one of {allowed}\n" in done.stderr


def test_settings_take_the_fakes_only_while_the_test_doubles_are_installed() -> None:
    fakes = {"FARM_NVML": "fake:t4,l4", "FARM_NVENC": "fake"}
    settings = Settings.from_env(fakes)
    assert (settings.nvml, settings.nvenc) == ("fake:t4,l4", "fake")
    with doubles.removed():
        for name, raw in fakes.items():
            with pytest.raises(BadParameter, match=f"{name} '{raw}' is not one of"):
                Settings.from_env({name: raw})
        assert Settings.from_env({"FARM_NVML": "real", "FARM_NVENC": "off"}).nvenc == "off"
    with pytest.raises(BadParameter) as raised:
        Settings.from_env({"FARM_NVML": "nvidia"})
    assert raised.value.message == "FARM_NVML 'nvidia' is not one of auto, real, fake:..."


def test_unknown_log_level_is_refused() -> None:
    with pytest.raises(BadParameter):
        Settings.from_env({"FARM_LOG_LEVEL": "chatty"})


def test_with_validates_changes() -> None:
    assert Settings().with_(device="gpu").device == "gpu"
    with pytest.raises(BadParameter):
        Settings().with_(device="fpga")


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FARM_MAX_ATTEMPTS", "7")
    assert Settings.from_env().max_attempts == 7


def test_to_env_rebuilds_every_setting() -> None:
    # what the embedded farm hands its workers: a field missing from the table would be lost
    changed = Settings().with_(
        redis_url="unix:///tmp/r.sock", storage_dir=Path("/s"), work_dir=Path("/w"),
        device="gpu", gpu_index=1, gpu_backend="CUDA", cpu_threads=3, tile_timeout_s=9.5,
        inspect_timeout_s=7.0, max_attempts=5, python="/usr/bin/python3.11",
        log_level="DEBUG", nvml="real", cpu_render_slots=2, cpu_encode_sessions=3,
        gpu_render_slots=4, encoder_sessions_per_engine=6, host_encoder_budget=8,
        device_overrides='{"t4": {"render_slots": 1}}', render_vram_floor_mib=512,
        lease_ttl_s=2.5, agent_timeout_s=4.5, worker_silent_s=9.0, worker_retention_s=600.0,
        storage_url="s3://b/p", s3_endpoint_url="http://m:9000", s3_region="eu-west-1",
        s3_addressing_style="path", s3_storage_class="GLACIER_IR", s3_sse="aws:kms",
        s3_kms_key_id="k", s3_checksum="when_required", s3_multipart_threshold_mib=64,
        s3_multipart_chunk_mib=16, s3_max_concurrency=8, s3_max_attempts=9, s3_timeout_s=5.0,
        presign_expiry_s=60, tile_retention="keep",
        web_host="0.0.0.0", web_port=9443, tls_cert=Path("/c.pem"), tls_key=Path("/k.pem"),
        upload_max_bytes=5, unpack_max_bytes=6, session_ttl_s=7.0, upload_session_ttl_s=8.0,
        stop_grace_s=3.0,
        stream_host="0.0.0.0", stream_port=9090, stream_url="http://s:9090",
        stream_apps=Path("/apps.json"), stream_grace_s=5.0, stream_min_kbps=800,
        stream_max_kbps=9000, stream_vram_mib=256, nvenc="require", stun_urls="stun:s:3478",
        turn_urls="turn:t:3478", turn_secret="x", turn_ttl_s=60.0,
        metrics_port=9101, metrics_host="0.0.0.0", usage_prices='{"t4": 1}',
        usage_currency="EUR", grid_carbon_g_per_kwh=250.0, device_watts='{"cpu": 90}',
        usage_raw_retention_s=86400.0, job_retention_s=3600.0, storage_retry_s=30.0,
        sandbox="none", sandbox_uid=1000, sandbox_gid=1001, sandbox_cgroup="/sys/fs/cgroup/t",
        stream_memory_mib=100, stream_pids=10, stream_cpu_cores=0.5, stream_secret="s" * 32,
        stream_token_ttl_s=60.0,
        blender_memory_mib=512, blender_pids=64, blender_cpu_cores=1.5,
        web_origins="https://f.example", metrics_token="m", web_metrics_port=9102,
        project_max_uploads=2, project_max_inspections=3, project_max_queued_tiles=50,
        job_max_tiles=40, project_max_stored_bytes=1000, upload_checks=3,
        stream_connect_timeout_s=5.0, stream_input_rate=50.0, stream_message_max_bytes=4096,
        stream_capture_retries=5, stream_encode_mpx_s=100.0, stream_resize_max_width=1280,
        stream_resize_max_height=720, stream_file_max_mib=8, stream_audio=0,
        s3_public_url="https://s3.example", data_dir=Path("/d"), web_farm_metrics="off",
        webhook_allow_private=1, webhook_max_attempts=3, webhook_backoff_s=0.5,
        webhook_backoff_max_s=30.0, webhook_timeout_s=2.0, webhook_max_per_project=4,
        worker_tags="big,lic", tag_limits='{"lic": 2}', blocklist_failures=5,
        webhook_retry_after_max_s=60.0, webhook_secret_grace_s=600.0,
        estimate_probe_s=1.0, estimate_probe_pixels=4096, estimate_probe_frames=2,
        device_speeds='{"t4": 3}', estimate_errors_max=50,
        live_preview_ttl_s=60.0, live_preview_budget=0.5,
        live_webrtc_per_job=2, live_webrtc_peers=5, live_webrtc_idle_s=30.0,
        control_redis_url="redis://control:6379/0", cell="c2", cells="c1=http://a,c2=http://b",
    )  # fmt: skip
    assert {f.name for f in fields(Settings)} == set(ENV)
    for f in fields(Settings):
        assert getattr(changed, f.name) != getattr(Settings(), f.name), f.name
    assert Settings.from_env(changed.to_env()) == changed
