"""check_devices and explain_device_errors, on real device-mismatch errors from the meta device."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.doctor import is_device_mismatch
from gpukit.errors import DeviceMismatchError, InvalidArgumentError

META = torch.device("meta")
CPU = torch.device("cpu")


class Block(nn.Module):
    """A layer whose scale is a plain attribute, so .to() would not move it."""

    def __init__(self, scale_device: torch.device = CPU) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.scale = torch.ones(4, device=scale_device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * self.scale


class Encoder(nn.Module):
    def __init__(self, scale_device: torch.device = CPU) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.ReLU(), Block(scale_device)])

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["x"] * batch["mask"]
        for layer in self.layers:
            x = layer(x)
        return x


class MakesTensorInForward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(4, device=META)  # stands in for a forgotten device=


class Pairwise(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


def _batch(device: torch.device = CPU) -> dict[str, torch.Tensor]:
    return {"x": torch.ones(2, 4, device=device), "mask": torch.ones(2, 4, device=device)}


def test_check_devices_groups_parameters_and_inputs_by_device_when_they_agree() -> None:
    groups = gk.check_devices(Encoder(), _batch())
    assert list(groups) == [CPU]
    assert "layers.2.norm.weight" in groups[CPU]
    assert "batch['mask']" in groups[CPU]


def test_check_devices_names_the_input_on_the_wrong_device() -> None:
    batch = _batch()
    batch["mask"] = batch["mask"].to(META)
    with pytest.raises(DeviceMismatchError, match=r"batch\['mask'\]") as info:
        gk.check_devices(Encoder(), batch)
    assert "gk.to_device" in str(info.value)
    assert "meta" in str(info.value)


def test_check_devices_reads_past_an_input_that_contains_itself() -> None:
    loop: list[object] = [torch.ones(1, device=META)]
    loop.append(loop)
    assert gk.check_devices(nn.Identity(), loop) == {META: ["input[0]"]}


def test_check_devices_names_inputs_inside_namedtuples_and_lists() -> None:
    class TakesPair(nn.Module):
        def forward(self, pair: Pair, extras: list[torch.Tensor]) -> torch.Tensor:
            return pair.left

    with pytest.raises(DeviceMismatchError) as info:
        gk.check_devices(
            TakesPair(), Pair(torch.ones(1), torch.ones(1, device=META)), extras=[torch.ones(1)]
        )
    assert "pair.right" in str(info.value)
    assert "extras[0]" in str(info.value)


def test_check_devices_tells_to_move_the_module_when_its_parameters_are_split() -> None:
    model = Encoder()
    model.layers[0].to(META)
    with pytest.raises(DeviceMismatchError, match=r"module\.to\("):
        gk.check_devices(model, _batch())


def test_check_devices_accepts_cpu_scalars_next_to_tensors_on_another_device() -> None:
    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return x * scale

    groups = gk.check_devices(Scaled(), torch.ones(2, device=META), torch.tensor(2.0))
    assert groups == {META: ["x"], CPU: ["scale"]}


def test_check_devices_tells_to_move_inputs_of_a_module_without_parameters() -> None:
    with pytest.raises(DeviceMismatchError, match="Move every input"):
        gk.check_devices(Pairwise(), torch.ones(4), torch.ones(4, device=META))


def test_explain_device_errors_names_the_failing_submodule_and_the_plain_attribute() -> None:
    model = Encoder(scale_device=META)
    with pytest.raises(DeviceMismatchError) as info, gk.explain_device_errors():
        model(_batch())
    text = str(info.value)
    assert text.startswith("layers.2 (Block) failed in forward")
    assert "self.scale is a plain tensor attribute on meta" in text
    assert "register_buffer('scale'" in text


def test_explain_device_errors_keeps_pytorchs_error_as_the_cause() -> None:
    with pytest.raises(DeviceMismatchError) as info, gk.explain_device_errors():
        nn.Linear(4, 4, device=META)(torch.ones(2, 4))
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError)
    assert "is not on the expected device" in str(cause)


def test_explain_device_errors_reports_parameter_and_input_devices() -> None:
    with pytest.raises(DeviceMismatchError) as info, gk.explain_device_errors():
        nn.Linear(4, 4, device=META)(torch.ones(2, 4))
    text = str(info.value)
    assert "parameters and buffers: meta: weight, bias" in text
    assert "inputs: cpu: input" in text
    assert "to_empty" in text


def test_explain_device_errors_suspects_a_tensor_created_inside_forward() -> None:
    with (
        pytest.raises(DeviceMismatchError, match="created inside forward"),
        gk.explain_device_errors(),
    ):
        MakesTensorInForward()(torch.ones(4))


def test_explain_device_errors_works_as_a_decorator() -> None:
    model = nn.Linear(4, 4, device=META)

    @gk.explain_device_errors()
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    with pytest.raises(DeviceMismatchError, match="Linear failed in forward"):
        step(torch.ones(2, 4))


def test_explain_device_errors_explains_mismatches_outside_any_module() -> None:
    with (
        pytest.raises(DeviceMismatchError, match=r"not happen inside an nn\.Module"),
        gk.explain_device_errors(),
    ):
        torch.ones(2, device=META) + torch.ones(2)


def test_explain_device_errors_lets_other_errors_through_untouched() -> None:
    error = RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x4)")

    def fail() -> None:
        raise error

    with pytest.raises(RuntimeError) as info, gk.explain_device_errors():
        fail()
    assert info.value is error


def test_explain_device_errors_registers_no_hooks_and_returns_results_unchanged() -> None:
    from torch.nn.modules import module as module_impl

    model = Encoder()
    batch = _batch()
    expected = model(batch)
    with gk.explain_device_errors():
        assert not module_impl._global_forward_pre_hooks
        assert not module_impl._global_forward_hooks
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
        result = model(batch)
    assert torch.equal(result, expected)


def test_nested_explain_blocks_explain_once() -> None:
    with (
        pytest.raises(DeviceMismatchError) as info,
        gk.explain_device_errors(),
        gk.explain_device_errors(),
    ):
        nn.Linear(4, 4, device=META)(torch.ones(2, 4))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not isinstance(info.value.__cause__, DeviceMismatchError)


def test_is_device_mismatch_recognises_cuda_and_meta_messages() -> None:
    cuda_message = (
        "Expected all tensors to be on the same device, but found at least two devices, "
        "cuda:0 and cpu! (when checking argument for argument mat1 in method wrapper_addmm)"
    )
    assert is_device_mismatch(RuntimeError(cuda_message))
    assert is_device_mismatch(
        RuntimeError("Tensor on device cpu is not on the expected device meta!")
    )
    assert not is_device_mismatch(RuntimeError("CUDA out of memory."))


def test_check_devices_refuses_something_that_is_not_a_module() -> None:
    with pytest.raises(InvalidArgumentError, match="not a function"):
        gk.check_devices(lambda x: x, torch.ones(2))  # type: ignore[arg-type]
