"""Tests of the NVML layer: the fake's GPUs and faults, open_nvml, and RealNvml's mapping of
pynvml's answers and errors (pynvml patched: this machine has no NVIDIA driver)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from farm.errors import BadParameter, NvmlError
from farm.gpu.factory import open_nvml
from farm.gpu.fake import FAKE_MODELS, FakeNvml
from farm.gpu.real import RealNvml
from farm.gpu.types import NVENC_ENGINES, GpuProcess, model_of, nvenc_engines
from tests import doubles

MIB = 1024 * 1024

# --- the fake ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "name", "memory_mib", "engines", "consumer"),
    [
        ("t4", "Tesla T4", 15360, 1, False),
        ("l4", "NVIDIA L4", 23034, 2, False),
        ("a10", "NVIDIA A10", 23028, 1, False),
        ("a100", "NVIDIA A100-SXM4-80GB", 81920, 0, False),
        ("h100", "NVIDIA H100 80GB HBM3", 81559, 0, False),
        ("rtx4090", "NVIDIA GeForce RTX 4090", 24564, 2, True),
    ],
)
def test_fake_models_look_like_nvidia_smi(
    key: str, name: str, memory_mib: int, engines: int, consumer: bool
) -> None:
    (gpu,) = FakeNvml([key]).devices()
    assert gpu.name == name
    assert gpu.memory_total_mib == memory_mib and gpu.memory_used_mib == 0
    assert gpu.encoder_engines == engines and gpu.encoder_sessions == 0
    assert gpu.consumer is consumer
    assert gpu.uuid == f"GPU-fake-{key}-0"
    assert gpu.processes == ()


def test_fake_engine_counts_agree_with_the_real_table() -> None:
    # The fake must not drift from what RealNvml would report for the same card.
    for key, model in FAKE_MODELS.items():
        assert model_of(model.name) == key
        assert nvenc_engines(model.name, capacity_pct=100, sessions=0) == model.encoder_engines


def test_spec_with_counts_and_mixed_models() -> None:
    nvml = open_nvml("fake:t4,2xl4,a100")
    assert isinstance(nvml, FakeNvml)
    gpus = nvml.devices()
    assert [g.name for g in gpus] == ["Tesla T4", "NVIDIA L4", "NVIDIA L4", "NVIDIA A100-SXM4-80GB"]
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert len({g.uuid for g in gpus}) == 4
    assert nvml.device_count() == 4
    assert nvml.device(2) == gpus[2]
    assert FakeNvml(["RTX 4090"]).devices()[0].consumer


def test_unknown_fake_model_lists_the_known_ones() -> None:
    with pytest.raises(BadParameter) as caught:
        FakeNvml(["t4", "v100"])
    assert "v100" in caught.value.message
    for key in ("a100", "l4", "rtx4090", "t4"):
        assert key in caught.value.message
    with pytest.raises(BadParameter):
        FakeNvml(["0xl4"])


def test_set_usage_changes_what_is_reported() -> None:
    nvml = FakeNvml(["l4", "t4"])
    nvml.set_usage(
        0,
        memory_used_mib=6000,
        encoder_sessions=3,
        processes=[GpuProcess(pid=4242, used_mib=5800)],
    )
    gpu = nvml.device(0)
    assert gpu.memory_used_mib == 6000 and gpu.encoder_sessions == 3
    assert gpu.processes == (GpuProcess(4242, 5800),)
    nvml.set_usage(0, encoder_sessions=0)
    assert nvml.device(0).memory_used_mib == 6000  # left alone
    assert nvml.device(0).encoder_sessions == 0
    assert nvml.device(1).memory_used_mib == 0
    with pytest.raises(BadParameter):
        nvml.set_usage(1, memory_used_mib=20000)  # more than a T4 has
    with pytest.raises(BadParameter):
        nvml.set_usage(2, memory_used_mib=1)


def test_lost_gpu_fails_every_query_that_touches_it() -> None:
    nvml = FakeNvml(["t4", "l4"])
    nvml.lose(1)
    for query in (lambda: nvml.device(1), nvml.devices):
        with pytest.raises(NvmlError) as caught:
            query()
        assert caught.value.fields["lost"] is True
        assert caught.value.fields["index"] == 1
    assert nvml.device(0).name == "Tesla T4"  # the others still answer


def test_fail_next_fails_that_many_queries_then_recovers() -> None:
    nvml = FakeNvml(["t4"])
    nvml.fail_next(2)
    for _ in range(2):
        with pytest.raises(NvmlError) as caught:
            nvml.devices()
        assert caught.value.fields["lost"] is False
    assert len(nvml.devices()) == 1
    assert nvml.driver_version()


def test_queries_after_close_fail() -> None:
    nvml = FakeNvml(["t4"])
    nvml.close()
    with pytest.raises(NvmlError):
        nvml.devices()


def test_index_past_the_last_gpu_is_an_nvml_error() -> None:
    with pytest.raises(NvmlError) as caught:
        FakeNvml(["t4"]).device(1)
    assert caught.value.fields == {"index": 1, "lost": False, "nvml_code": 2}


# --- open_nvml -----------------------------------------------------------------------------


def _driver_installed() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


no_driver = pytest.mark.skipif(_driver_installed(), reason="an NVIDIA driver is installed here")


@no_driver
def test_auto_without_a_driver_means_no_nvml() -> None:
    assert open_nvml("auto") is None


@no_driver
def test_real_without_a_driver_says_what_to_do() -> None:
    with pytest.raises(NvmlError) as caught:
        open_nvml("real")
    message = caught.value.message
    assert "FARM_NVML=real" in message and "NVIDIA driver" in message
    assert "Library Not Found" in message
    assert caught.value.fields["nvml_code"] == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND


def test_unknown_spec_is_refused() -> None:
    with pytest.raises(BadParameter):
        open_nvml("nvidia")


def test_without_the_test_doubles_the_fake_is_refused_naming_the_real_values() -> None:
    with doubles.removed(), pytest.raises(BadParameter) as refused:
        open_nvml("fake:t4")
    assert refused.value.message == "FARM_NVML 'fake:t4' is not one of auto, real"


# --- model table -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("Tesla T4", "t4"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA RTX 6000 Ada Generation", None),
    ],
)
def test_model_of_matches_whole_words(name: str, model: str | None) -> None:
    assert model_of(name) == model


def test_engines_from_the_table_or_the_probe() -> None:
    assert nvenc_engines("NVIDIA L40S", 100, 0) == 3
    assert nvenc_engines("NVIDIA H100 80GB HBM3", 0, 0) == 0
    # not supported: no encoder exposed here (a vGPU or MIG slice), whatever the model
    assert nvenc_engines("NVIDIA L4", None, 0) == 0
    assert nvenc_engines("NVIDIA RTX 6000 Ada Generation", 100, 0) == 1
    assert nvenc_engines("NVIDIA RTX 6000 Ada Generation", 0, 2) == 1  # busy, still there
    assert nvenc_engines("Some Compute Card", 0, 0) == 0
    assert set(NVENC_ENGINES) >= {"t4", "a10", "a10g", "a16", "a40", "l4", "l40", "l40s"}


# --- RealNvml over a patched pynvml ------------------------------------------------------------


@dataclass
class Driver:
    """What a patched pynvml answers: one GPU, plus errors by function name."""

    name: str = "NVIDIA L4"
    brand: int = pynvml.NVML_BRAND_NVIDIA
    errors: dict[str, int] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        answers: dict[str, Any] = {
            "nvmlInit": None,
            "nvmlShutdown": None,
            "nvmlSystemGetDriverVersion": "550.127.05",
            "nvmlDeviceGetCount": 1,
            "nvmlDeviceGetHandleByIndex": object(),
            "nvmlDeviceGetUUID": "GPU-0c5e2c4a-1111-2222-3333-444455556666",
            "nvmlDeviceGetName": self.name,
            "nvmlDeviceGetMemoryInfo": SimpleNamespace(total=23034 * MIB, used=1500 * MIB),
            "nvmlDeviceGetEncoderStats": (3, 180, 900),
            "nvmlDeviceGetUtilizationRates": SimpleNamespace(gpu=37, memory=5),
            "nvmlDeviceGetPowerUsage": 41_250,  # mW
            "nvmlDeviceGetTotalEnergyConsumption": 7_500_000,  # mJ
            "nvmlDeviceGetEncoderCapacity": 62,
            "nvmlDeviceGetComputeRunningProcesses": [
                SimpleNamespace(pid=100, usedGpuMemory=1024 * MIB),
                SimpleNamespace(pid=200, usedGpuMemory=None),
            ],
            "nvmlDeviceGetGraphicsRunningProcesses": [
                SimpleNamespace(pid=100, usedGpuMemory=1024 * MIB),
            ],
            "nvmlDeviceGetBrand": self.brand,
        }
        for fn_name, answer in answers.items():
            monkeypatch.setattr(pynvml, fn_name, self._fn(fn_name, answer))

    def _fn(self, fn_name: str, answer: Any) -> Any:
        def fn(*args: Any) -> Any:
            self.calls.append(fn_name)
            if fn_name in self.errors:
                raise pynvml.NVMLError(self.errors[fn_name])
            return answer

        fn.__name__ = fn_name
        return fn


def test_real_nvml_converts_units_and_merges_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    Driver().install(monkeypatch)
    nvml = RealNvml()
    (gpu,) = nvml.devices()
    assert gpu.uuid.startswith("GPU-0c5e") and gpu.index == 0
    assert (gpu.memory_total_mib, gpu.memory_used_mib) == (23034, 1500)
    assert (gpu.encoder_engines, gpu.encoder_sessions, gpu.encoder_fps) == (2, 3, 180.0)
    assert gpu.utilization_pct == 37
    assert gpu.power_w == 41.25 and gpu.energy_j == 7500.0
    # pid 100 is in both lists; pid 200's memory is hidden
    assert gpu.processes == (GpuProcess(100, 1024), GpuProcess(200, 0))
    assert gpu.consumer is False
    assert nvml.driver_version() == "550.127.05"
    nvml.close()
    nvml.close()


def test_real_nvml_treats_unsupported_queries_as_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    not_supported = pynvml.NVML_ERROR_NOT_SUPPORTED
    driver = Driver(
        name="NVIDIA GeForce RTX 3090",
        brand=pynvml.NVML_BRAND_GEFORCE,
        errors={
            "nvmlDeviceGetPowerUsage": not_supported,
            "nvmlDeviceGetTotalEnergyConsumption": not_supported,
            "nvmlDeviceGetEncoderStats": not_supported,
        },
    )
    driver.install(monkeypatch)
    gpu = RealNvml().device(0)
    assert gpu.power_w is None and gpu.energy_j is None
    assert (gpu.encoder_sessions, gpu.encoder_fps) == (0, 0.0)
    assert gpu.encoder_engines == 1 and gpu.consumer is True


def test_real_nvml_gpu_without_nvenc(monkeypatch: pytest.MonkeyPatch) -> None:
    Driver(
        name="NVIDIA H100 80GB HBM3",
        errors={"nvmlDeviceGetEncoderCapacity": pynvml.NVML_ERROR_NOT_SUPPORTED},
    ).install(monkeypatch)
    assert RealNvml().device(0).encoder_engines == 0


def test_real_nvml_probes_engines_once_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = Driver(name="NVIDIA RTX 6000 Ada Generation")
    driver.install(monkeypatch)
    nvml = RealNvml()
    assert [nvml.device(0).encoder_engines for _ in range(3)] == [1, 1, 1]
    assert driver.calls.count("nvmlDeviceGetEncoderCapacity") == 1


def test_real_nvml_reports_a_lost_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    Driver(errors={"nvmlDeviceGetHandleByIndex": pynvml.NVML_ERROR_GPU_IS_LOST}).install(
        monkeypatch
    )
    with pytest.raises(NvmlError) as caught:
        RealNvml().devices()
    assert caught.value.fields["lost"] is True
    assert caught.value.fields["index"] == 0
    assert "GPU 0 fell off the bus" in caught.value.message
    assert "GPU is lost" in caught.value.message


def test_real_nvml_lost_mid_query_is_still_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    # "GPU is lost" can come from any query, not only the handle lookup; not-supported
    # tolerance must not swallow it
    Driver(errors={"nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_GPU_IS_LOST}).install(monkeypatch)
    with pytest.raises(NvmlError) as caught:
        RealNvml().device(0)
    assert caught.value.fields["lost"] is True


def test_real_nvml_other_errors_name_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    Driver(errors={"nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_NO_PERMISSION}).install(monkeypatch)
    with pytest.raises(NvmlError) as caught:
        RealNvml().device(0)
    err = caught.value
    assert err.fields["lost"] is False and err.fields["index"] == 0
    assert "nvmlDeviceGetMemoryInfo" in err.message and "Insufficient Permissions" in err.message


def test_auto_answers_none_when_init_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    Driver(errors={"nvmlInit": pynvml.NVML_ERROR_DRIVER_NOT_LOADED}).install(monkeypatch)
    assert open_nvml("auto") is None
    with pytest.raises(NvmlError) as caught:
        open_nvml("real")
    assert "Driver Not Loaded" in caught.value.message
