"""gk.device, try_gpu, try_all_gpus, placement and module_device."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.errors import DeviceError, MixedDevicesError
from tests.helpers import run_python

# torch's own count, kept before a fixture of the suite can replace it on a GPU machine.
_TORCH_DEVICE_COUNT = torch.cuda.device_count


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch report two visible CUDA devices (nothing here touches them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def test_auto_is_cpu_without_gpu_or_mps(no_gpu: None) -> None:
    assert gk.device("auto") == torch.device("cpu")
    assert gk.device() == torch.device("cpu")


def test_auto_is_first_cuda_device_when_one_is_visible(two_gpus: None) -> None:
    assert gk.device("auto") == torch.device("cuda", 0)


def test_auto_prefers_mps_when_there_is_no_cuda(
    no_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert gk.device("auto") == torch.device("mps")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cpu", torch.device("cpu")),
        (torch.device("cpu"), torch.device("cpu")),
        ("cuda", torch.device("cuda", 0)),
        ("cuda:1", torch.device("cuda", 1)),
        (1, torch.device("cuda", 1)),
        (torch.device("cuda", 1), torch.device("cuda", 1)),
        (torch.device("cuda"), torch.device("cuda", 0)),
    ],
)
def test_device_accepts_every_documented_form(
    two_gpus: None, spec: object, expected: torch.device
) -> None:
    assert gk.device(spec) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["gpu", "cuda0", "cuda:-1", "cuda:x", "", "CPU", "cpu:1", "tpu"])
def test_device_rejects_unknown_names_with_the_accepted_forms(spec: str) -> None:
    with pytest.raises(DeviceError, match='Use "cpu", "cuda", "cuda:N", "mps", or "auto"'):
        gk.device(spec)


def test_device_suggests_cuda_for_gpu() -> None:
    with pytest.raises(DeviceError, match='Did you mean "cuda"'):
        gk.device("gpu")


@pytest.mark.parametrize("spec", [None, 1.5, True, [0]])
def test_device_rejects_values_that_are_not_specs(spec: object) -> None:
    with pytest.raises(DeviceError):
        gk.device(spec)  # type: ignore[arg-type]


def test_invisible_index_lists_visible_devices_and_the_environment(two_gpus: None) -> None:
    with pytest.raises(DeviceError) as info:
        gk.device("cuda:3")
    assert str(info.value) == (
        "cuda:3 is not visible: this process sees 2 CUDA devices (cuda:0, cuda:1; "
        'CUDA_VISIBLE_DEVICES=0,1). Use one of those, or gk.device("auto").'
    )


def test_negative_index_is_rejected(two_gpus: None) -> None:
    with pytest.raises(DeviceError, match="negative"):
        gk.device(-1)


def test_cuda_without_gpu_says_there_is_none_and_points_to_cpu(no_gpu: None) -> None:
    with pytest.raises(DeviceError, match="sees no CUDA devices") as info:
        gk.device("cuda")
    assert '"cpu"' in str(info.value)


def test_mps_is_rejected_where_it_is_missing(no_gpu: None) -> None:
    with pytest.raises(DeviceError, match="MPS"):
        gk.device("mps")


def test_device_errors_are_value_errors_for_existing_handlers() -> None:
    with pytest.raises(ValueError, match="not a device spec"):
        gk.device("gpu")


def test_try_gpu_falls_back_to_cpu(no_gpu: None) -> None:
    assert gk.try_gpu() == torch.device("cpu")
    assert gk.try_gpu(3) == torch.device("cpu")


def test_try_gpu_returns_the_gpu_when_it_exists(two_gpus: None) -> None:
    assert gk.try_gpu(1) == torch.device("cuda", 1)
    assert gk.try_gpu(2) == torch.device("cpu")


def test_try_all_gpus_is_cpu_alone_without_gpus(no_gpu: None) -> None:
    assert gk.try_all_gpus() == [torch.device("cpu")]


def test_try_all_gpus_lists_every_visible_gpu(two_gpus: None) -> None:
    assert gk.try_all_gpus() == [torch.device("cuda", 0), torch.device("cuda", 1)]


def _split_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    model[0].to("meta")
    return model


def test_placement_groups_parameters_and_buffers_by_device() -> None:
    groups = gk.placement(_split_model())
    assert groups[torch.device("meta")] == ["0.weight", "0.bias"]
    assert groups[torch.device("cpu")] == [
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]


def test_module_device_is_the_single_device() -> None:
    assert gk.module_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert gk.module_device(nn.Linear(2, 2, device="meta")) == torch.device("meta")


def test_module_without_tensors_is_on_cpu() -> None:
    assert gk.module_device(nn.ReLU()) == torch.device("cpu")


def test_mixed_module_names_which_tensors_live_where() -> None:
    with pytest.raises(MixedDevicesError) as info:
        gk.module_device(_split_model())
    message = str(info.value)
    assert "meta: 0.weight, 0.bias" in message
    assert "cpu: 1.weight, 1.bias, 1.running_mean, and 2 more" in message
    assert "module.to(device)" in message


def test_asking_about_devices_does_not_start_cuda() -> None:
    code = (
        "import torch, gpukit as gk; gk.device('auto'); gk.try_all_gpus(); gk.try_gpu(0);"
        "print(torch.cuda.is_initialized())"
    )
    out = run_python(code)
    assert out.strip() == "False"


def test_index_with_a_leading_zero_is_a_device_error() -> None:
    with pytest.raises(DeviceError, match="not a device spec"):
        gk.device("cuda:01")


def test_upper_case_name_gets_the_lower_case_suggestion() -> None:
    with pytest.raises(DeviceError, match='Did you mean "cpu"'):
        gk.device("CPU")


def test_device_list_refuses_a_single_string() -> None:
    from gpukit.devices import device_list

    with pytest.raises(DeviceError, match=r"a list of devices, not the single value 'cpu'"):
        device_list("cpu")  # type: ignore[arg-type]
    assert device_list(["cpu"] * 2) == [torch.device("cpu")] * 2


@pytest.fixture
def nvml_counts(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], list[str]]:
    """A CUDA build of torch whose NVML sees ``n`` GPUs (-1: no NVML); records driver starts."""
    started: list[str] = []

    def set_count(n: int) -> list[str]:
        monkeypatch.setattr(torch.cuda, "device_count", _TORCH_DEVICE_COUNT)
        monkeypatch.setattr(torch.cuda, "_cached_device_count", None, raising=False)
        monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
        monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: started.append("is_available"))

        def cuda_get_device_count() -> int:
            started.append("cudaGetDeviceCount")
            return 1

        monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", cuda_get_device_count, raising=False)
        return started

    return set_count


def test_devices_are_counted_through_nvml_without_starting_the_driver(
    nvml_counts: Callable[[int], list[str]],
) -> None:
    started = nvml_counts(2)
    assert gk.device("auto") == torch.device("cuda", 0)
    assert gk.try_gpu(1) == torch.device("cuda", 1)
    assert gk.try_all_gpus() == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert gk.device("cuda:1") == torch.device("cuda", 1)
    assert started == []


def test_devices_are_counted_by_cuda_only_where_nvml_is_missing(
    nvml_counts: Callable[[int], list[str]],
) -> None:
    started = nvml_counts(-1)
    assert gk.try_all_gpus() == [torch.device("cuda", 0)]
    assert started == ["cudaGetDeviceCount"]


def test_a_cuda_index_too_large_for_torch_is_a_device_error() -> None:
    with pytest.raises(DeviceError, match="cuda:99999999999999999999 is not visible"):
        gk.device("cuda:" + "9" * 20)


@pytest.mark.parametrize("spec", ["meta", "xpu", "hpu", "privateuseone", "xpu:1", "hpu:0"])
def test_any_device_type_torch_knows_is_accepted_as_a_string(spec: str) -> None:
    assert gk.device(spec) == torch.device(spec)


def test_to_device_accepts_the_meta_device_by_name() -> None:
    moved = gk.to_device({"x": torch.ones(2)}, "meta")
    assert moved["x"].device == torch.device("meta")


@pytest.mark.parametrize("i", ["x", "0", 1.0, None, True, -1])
def test_try_gpu_refuses_what_is_not_a_gpu_index(i: object) -> None:
    with pytest.raises(DeviceError, match=r"try_gpu\("):
        gk.try_gpu(i)  # type: ignore[arg-type]
