"""Tensor activity from GPM against the fake NVML: a value from the second reading on, none on
GPUs without GPM, and every sample NVML allocates freed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpukit.errors import NvmlError
from gpukit.gpus.fake_nvml import (
    FakeNvml,
    check_description,
    gpm_samples_held,
    load_description,
)
from gpukit.gpus.gpm import MIN_INTERVAL_S, TensorActivity, tensor_active
from gpukit.gpus.inventory import Inventory, _Reader, inventory
from tests.helpers import MACHINES

H100 = "GPU-923a7369-94e3-bf91-1a61-dbe22e44158b"  # GPU 1 of server-2xH100-mig: 6.25 % tensor
H100_MIG = "GPU-6b4cb242-4a23-d596-2217-beaddbc496cb"  # GPU 0, in MIG mode: no GPM described


def _machine(tmp_path: Path, name: str, **per_gpu: dict[str, Any]) -> Path:
    """A copy of a shipped machine, with readings of GPUs changed (``gpu1={...}``)."""
    data = json.loads((MACHINES / f"{name}.json").read_text())
    for key, changes in per_gpu.items():
        data["gpus"][int(key.removeprefix("gpu"))].update(changes)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``fake(path)``: that machine's inventory, one fake NVML whose samples are counted, and a
    TensorActivity reading it (closed at the end, whatever the test asserted before)."""
    made: list[TensorActivity] = []

    def use(path: Path) -> tuple[Inventory, FakeNvml, TensorActivity]:
        monkeypatch.setenv("GPUKIT_FAKE_NVML", str(path))
        nvml = FakeNvml(load_description(path))
        nvml.nvmlInit()
        made.append(TensorActivity(nvml))
        return inventory(), nvml, made[-1]

    held = gpm_samples_held()
    yield use
    for activity in made:
        activity.close()
    assert gpm_samples_held() == held, "a test left GPM samples allocated"


def _later() -> None:
    time.sleep(MIN_INTERVAL_S * 1.5)  # NVML compares samples at least 100 ms apart


def test_a_first_reading_has_no_tensor_activity(fake: Any) -> None:
    inv, _nvml, activity = fake(MACHINES / "server-2xH100-mig.json")
    assert activity.read(inv) == {}
    activity.close()


def test_a_second_reading_gives_the_described_percent_as_a_ratio(fake: Any, tmp_path: Path) -> None:
    inv, _nvml, activity = fake(
        _machine(tmp_path, "server-2xH100-mig", gpu1={"tensor_active_percent": 37.5})
    )
    activity.read(inv)
    _later()
    assert activity.read(inv) == {H100: 0.375}
    activity.close()


def test_every_reading_after_the_first_has_a_value(fake: Any) -> None:
    inv, _nvml, activity = fake(MACHINES / "server-2xH100-mig.json")
    readings = []
    for _ in range(4):
        readings.append(activity.read(inv))
        _later()
    activity.close()
    assert readings == [{}, {H100: 0.0625}, {H100: 0.0625}, {H100: 0.0625}]


def test_an_idle_gpu_with_gpm_reads_zero_not_nothing(fake: Any, tmp_path: Path) -> None:
    inv, _nvml, activity = fake(
        _machine(tmp_path, "server-2xH100-mig", gpu1={"tensor_active_percent": 0})
    )
    activity.read(inv)
    _later()
    assert activity.read(inv) == {H100: 0.0}
    activity.close()


def test_a_gpu_in_mig_mode_without_gpm_described_has_no_value(fake: Any) -> None:
    inv, _nvml, activity = fake(MACHINES / "server-2xH100-mig.json")
    activity.read(inv)
    _later()
    assert H100_MIG not in activity.read(inv)
    activity.close()


@pytest.mark.parametrize("name", ["server-8xA100-shared", "server-4xL4-idle", "laptop-rtx3060"])
def test_a_gpu_before_hopper_has_no_value_and_holds_no_sample(fake: Any, name: str) -> None:
    inv, nvml, activity = fake(MACHINES / f"{name}.json")
    assert [activity.read(inv) for _ in range(2)] == [{}, {}]
    assert nvml.gpm_allocated == 0
    activity.close()


@pytest.mark.parametrize("missing", ["nvmlGpmQueryDeviceSupport", "nvmlGpmSampleGet"])
def test_a_driver_without_gpm_has_no_value_and_holds_no_sample(
    fake: Any, tmp_path: Path, missing: str
) -> None:
    path = _machine(tmp_path, "server-2xH100-mig")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "unsupported_functions": [missing]}))
    inv, nvml, activity = fake(path)
    activity.read(inv)
    _later()
    assert activity.read(inv) == {}
    assert nvml.gpm_allocated == nvml.gpm_freed
    activity.close()


def test_a_mig_instance_handle_has_no_gpm(fake: Any) -> None:
    _, nvml, _ = fake(MACHINES / "server-2xH100-mig.json")
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(nvml.nvmlDeviceGetHandleByIndex(0), 0)
    assert tensor_active(_Reader(nvml), mig, None) == (None, None)


def test_each_reading_frees_the_sample_before_it(fake: Any) -> None:
    inv, nvml, activity = fake(MACHINES / "server-2xH100-mig.json")
    for _ in range(5):
        activity.read(inv)
        _later()
    # One sample per reading of the one GPU with GPM; only the last one is still kept.
    assert (nvml.gpm_allocated, nvml.gpm_freed) == (5, 4)
    activity.close()
    assert nvml.gpm_freed == 5


def test_a_gpu_that_leaves_the_readings_has_its_sample_freed(fake: Any) -> None:
    inv, nvml, activity = fake(MACHINES / "server-2xH100-mig.json")
    activity.read(inv)
    _later()
    assert activity.read(Inventory(gpus=())) == {}
    assert nvml.gpm_allocated == nvml.gpm_freed == 1
    activity.close()


def test_a_reading_too_soon_after_the_last_keeps_the_last_sample(fake: Any) -> None:
    inv, nvml, activity = fake(MACHINES / "server-2xH100-mig.json")
    activity.read(inv)
    assert activity.read(inv) == {}  # within 100 ms: nothing to compare yet
    _later()
    assert activity.read(inv) == {H100: 0.0625}
    assert (nvml.gpm_allocated, nvml.gpm_freed) == (2, 1)
    activity.close()


def test_a_driver_failing_gpm_raises_nvml_error_and_frees_every_sample(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    inv, nvml, activity = fake(MACHINES / "server-2xH100-mig.json")
    activity.read(inv)
    _later()

    def unknown(request: Any) -> Any:
        raise pynvml.NVMLError_Unknown()

    monkeypatch.setattr(nvml, "nvmlGpmMetricsGet", unknown)
    with pytest.raises(NvmlError, match="Unknown Error"):
        activity.read(inv)
    assert nvml.gpm_allocated == nvml.gpm_freed == 2
    monkeypatch.undo()
    _later()
    assert activity.read(inv) == {}  # starts afresh
    activity.close()


def test_a_percent_nvml_does_not_give_is_no_value(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    inv, nvml, activity = fake(MACHINES / "server-2xH100-mig.json")
    activity.read(inv)
    _later()
    answer = nvml.nvmlGpmMetricsGet

    def not_this_metric(request: Any) -> Any:
        answer(request)
        request.metrics[0].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return request

    monkeypatch.setattr(nvml, "nvmlGpmMetricsGet", not_this_metric)
    assert activity.read(inv) == {}
    activity.close()


def test_the_fake_refuses_a_sample_freed_twice(fake: Any) -> None:
    _, nvml, _ = fake(MACHINES / "server-2xH100-mig.json")
    sample = nvml.nvmlGpmSampleAlloc()
    nvml.nvmlGpmSampleFree(sample)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlGpmSampleFree(sample)
    assert (nvml.gpm_allocated, nvml.gpm_freed) == (1, 1)


def test_the_inventory_reads_no_gpm(fake: Any) -> None:
    # `gpukit list` is one reading: it has no earlier sample to compare with, so takes none.
    fake(MACHINES / "server-2xH100-mig.json")
    before = gpm_samples_held()
    inventory()
    assert gpm_samples_held() == before


@pytest.mark.parametrize("value", [-1, 100.5, "37.5", True])
def test_a_tensor_percent_outside_0_to_100_is_named_in_the_description_check(value: Any) -> None:
    [problem] = check_description({"gpus": [{"tensor_active_percent": value}]})
    assert problem.startswith("gpus[0].tensor_active_percent is ")
    assert problem.endswith("not a number from 0 to 100, or null")
