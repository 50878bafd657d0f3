"""What gk.to_device asks torch to do: pinning, non-blocking copies, ``.to`` of other objects, skip.

The copy options matter only for a GPU target. ``OneGpu`` lets these tests run anywhere: it
shows gpukit a machine with one GPU, ``cuda:0``, records every copy and every pin that gpukit
asks torch for, and does none of them. A copy to ``cuda:0`` gives a new tensor that reports
itself on ``cuda:0``; ``pin_memory`` gives a new one that reports itself pinned.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import gpukit as gk
from gpukit import transfer
from gpukit.errors import InvalidArgumentError

CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")
META = torch.device("meta")
NOT_GIVEN = "not given"


class OneGpu(TorchFunctionMode):
    """torch as gpukit sees it on a machine with one GPU, without touching any GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.device, object]] = []  # (device, non_blocking) per .to()
        self.sources: list[torch.Tensor] = []  # the tensor each copy was made from
        self.pinned_from: list[torch.Tensor] = []  # the tensors pin_memory() was called on
        # Kept by id, with the tensor itself, so that no id is reused while the mode lives.
        self._on_gpu: dict[int, torch.Tensor] = {}
        self._pinned: dict[int, torch.Tensor] = {}

    def gpu_tensor(self) -> torch.Tensor:
        """A tensor that lives on cuda:0."""
        t = torch.ones(2)
        self._on_gpu[id(t)] = t
        return t

    def pinned_tensor(self) -> torch.Tensor:
        """A host tensor in pinned (page-locked) memory."""
        t = torch.ones(2)
        self._pinned[id(t)] = t
        return t

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        first: Any = args[0] if args else None
        on_gpu = id(first) in self._on_gpu
        if func is torch.Tensor.to:
            target = torch.device(args[1] if len(args) > 1 else kwargs["device"])
            self.copies.append((target, kwargs.get("non_blocking", NOT_GIVEN)))
            self.sources.append(first)
            if target.type != "cuda" and not on_gpu:
                return func(*args, **kwargs)
            out = first.detach().clone()
            if target.type == "cuda":
                self._on_gpu[id(out)] = out
            return out
        if func is torch.Tensor.pin_memory:
            if on_gpu:
                raise RuntimeError("only dense CPU tensors can be pinned")
            self.pinned_from.append(first)
            out = first.detach().clone()
            self._pinned[id(out)] = out
            return out
        if func is torch.Tensor.is_pinned:
            return id(first) in self._pinned
        if on_gpu and func == torch.Tensor.device.__get__:
            return CUDA0
        if on_gpu and func == torch.Tensor.is_cpu.__get__:  # type: ignore[attr-defined]
            return False
        if on_gpu and func == torch.Tensor.is_cuda.__get__:  # type: ignore[attr-defined]
            return True
        return func(*args, **kwargs)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[OneGpu]:
    """A machine with one visible GPU, cuda:0, whose copies are recorded instead of made."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with OneGpu() as mode:
        yield mode


# -- copies to a GPU ---------------------------------------------------------------------------


def test_pinned_host_memory_goes_to_the_gpu_without_blocking_by_default(gpu: OneGpu) -> None:
    pinned = gpu.pinned_tensor()
    moved = gk.to_device({"x": pinned}, "cuda:0")
    assert gpu.copies == [(CUDA0, True)]
    assert gpu.sources[0] is pinned
    assert gpu.pinned_from == []
    assert moved["x"].device == CUDA0


def test_pageable_host_memory_goes_to_the_gpu_blocking_and_unpinned_by_default(
    gpu: OneGpu,
) -> None:
    # A non-blocking copy from pageable memory is no faster, so "auto" does not ask for one;
    # and nothing is pinned unless pin=True.
    t = torch.ones(2)
    gk.to_device([t], "cuda:0")
    assert gpu.copies == [(CUDA0, False)]
    assert gpu.pinned_from == []


def test_pin_true_pins_pageable_host_tensors_then_copies_them_without_blocking(
    gpu: OneGpu,
) -> None:
    t = torch.ones(2)
    gk.to_device({"x": t}, "cuda:0", pin=True)
    assert len(gpu.pinned_from) == 1
    assert gpu.pinned_from[0] is t
    assert gpu.copies == [(CUDA0, True)]
    assert gpu.sources[0] is not t  # the pinned copy is what goes to the GPU
    assert gpu.sources[0].is_pinned()


def test_pin_true_does_not_pin_a_tensor_already_pinned_again(gpu: OneGpu) -> None:
    pinned = gpu.pinned_tensor()
    gk.to_device(pinned, "cuda:0", pin=True)
    assert gpu.pinned_from == []
    assert gpu.copies == [(CUDA0, True)]
    assert gpu.sources[0] is pinned


def test_pin_true_leaves_a_tensor_already_on_the_gpu_alone(gpu: OneGpu) -> None:
    on_gpu, host = gpu.gpu_tensor(), torch.ones(2)
    moved = gk.to_device({"gpu": on_gpu, "host": host}, "cuda:0", pin=True)
    assert moved["gpu"] is on_gpu
    assert len(gpu.pinned_from) == 1
    assert gpu.pinned_from[0] is host
    assert gpu.copies == [(CUDA0, True)]


@pytest.mark.parametrize("non_blocking", [True, False])
def test_an_explicit_non_blocking_is_passed_to_every_copy_as_given(
    gpu: OneGpu, non_blocking: bool
) -> None:
    batch = {"pinned": gpu.pinned_tensor(), "pageable": torch.ones(2)}
    gk.to_device(batch, "cuda:0", non_blocking=non_blocking)
    assert [device for device, _ in gpu.copies] == [CUDA0, CUDA0]
    assert all(nb is non_blocking for _, nb in gpu.copies)
    assert gpu.pinned_from == []


# -- copies elsewhere --------------------------------------------------------------------------


def test_copies_from_the_gpu_back_to_the_host_block_by_default(gpu: OneGpu) -> None:
    # The host could read the result before a non-blocking device-to-host copy finished.
    on_gpu = gpu.gpu_tensor()
    moved = gk.to_device({"loss": on_gpu}, "cpu")
    assert gpu.copies == [(CPU, False)]
    assert gpu.sources[0] is on_gpu
    assert moved["loss"] is not on_gpu


def test_a_tensor_already_on_the_gpu_is_not_copied_again(gpu: OneGpu) -> None:
    on_gpu = gpu.gpu_tensor()
    batch = {"x": on_gpu}
    assert gk.to_device(batch, "cuda:0") is batch
    assert gpu.copies == []


def test_pin_and_auto_change_nothing_for_a_target_that_is_not_a_gpu(gpu: OneGpu) -> None:
    pageable, pinned = torch.ones(2), gpu.pinned_tensor()
    moved = gk.to_device([pageable, pinned], META, pin=True)
    assert gpu.pinned_from == []
    assert gpu.copies == [(META, False), (META, False)]
    assert moved[0].device == META


def test_the_per_step_mover_copies_as_to_device_does_and_never_pins(gpu: OneGpu) -> None:
    # DataParallel moves each step's inputs with it.
    move = transfer.mover(CUDA0)
    move({"pinned": gpu.pinned_tensor(), "pageable": torch.ones(2)})
    assert gpu.copies == [(CUDA0, True), (CUDA0, False)]
    assert gpu.pinned_from == []


def test_the_per_step_mover_moves_modules_and_objects_with_a_to_method() -> None:
    model = nn.Linear(2, 2)
    moved = transfer.mover(META)({"model": model, "obj": Recorder()})
    assert moved["model"] is model
    assert model.weight.device == META
    assert moved["obj"].calls == [((META,), {"non_blocking": False})]


# -- other objects -----------------------------------------------------------------------------


class Recorder:
    """An object whose ``.to`` accepts anything and returns a new object recording the call."""

    def __init__(self, calls: list[Any] | None = None) -> None:
        self.calls = calls or []

    def to(self, *args: Any, **kwargs: Any) -> Recorder:
        return Recorder([*self.calls, (args, kwargs)])


@pytest.mark.parametrize(
    ("non_blocking", "passed"), [("auto", False), (False, False), (True, True)]
)
def test_an_objects_to_gets_the_device_and_non_blocking_true_only_when_asked_for(
    non_blocking: Any, passed: bool
) -> None:
    moved = gk.to_device({"obj": Recorder()}, META, non_blocking=non_blocking)
    assert moved["obj"].calls == [((META,), {"non_blocking": passed})]


class DeviceOnly:
    """An object whose ``.to`` takes the device alone, as many simple wrappers' do."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device

    def to(self, device: torch.device) -> DeviceOnly:
        return DeviceOnly(device)


def test_an_object_whose_to_takes_only_the_device_is_moved_with_it() -> None:
    obj = DeviceOnly()
    moved = gk.to_device([obj], META)
    assert moved[0] is not obj
    assert moved[0].device == META


class Mail:
    """A record with a field that happens to be called ``to``."""

    def __init__(self, to: str) -> None:
        self.to = to


def test_objects_without_a_to_method_are_kept_as_they_are() -> None:
    kept: list[Any] = [
        Path("data/x.pt"),
        datetime.date(2026, 1, 1),
        object(),
        Mail("alice@example.com"),
    ]
    batch: dict[str, Any] = {"x": torch.ones(1), "kept": kept}
    moved = gk.to_device(batch, META)
    assert moved["x"].device == META
    assert all(a is b for a, b in zip(moved["kept"], kept, strict=True))


def test_a_class_in_the_batch_is_kept_not_called() -> None:
    config: dict[str, Any] = {"x": torch.ones(1), "layer": nn.Linear, "wrapper": DeviceOnly}
    moved = gk.to_device(config, META)
    assert moved["layer"] is nn.Linear
    assert moved["wrapper"] is DeviceOnly


def test_skip_still_moves_modules_and_objects_with_a_to_method() -> None:
    model, labels = nn.Linear(2, 2), torch.ones(1)
    batch: dict[str, Any] = {
        "model": model,
        "obj": DeviceOnly(),
        "path": Path("x"),
        "labels": labels,
    }
    moved = gk.to_device(batch, META, skip=["labels"])
    assert moved["model"] is model
    assert model.weight.device == META
    assert moved["obj"].device == META
    assert moved["path"] is batch["path"]
    assert moved["labels"] is labels


# -- skip and argument checks --------------------------------------------------------------------


def test_a_number_in_a_dotted_skip_path_is_a_list_position() -> None:
    keep = torch.ones(1)
    moved = gk.to_device({"xs": [torch.ones(1), keep]}, META, skip="xs.1")
    assert moved["xs"][0].device == META
    assert moved["xs"][1] is keep


@pytest.mark.parametrize("non_blocking", [True, False, "auto"])
def test_non_blocking_true_false_and_auto_are_accepted(non_blocking: Any) -> None:
    assert gk.to_device(torch.ones(1), META, non_blocking=non_blocking).device == META


def test_a_skip_that_is_no_key_says_what_to_pass() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        gk.to_device({"x": torch.ones(1)}, META, skip=5.5)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "skip=5.5 is not a key, a key path, or a collection of them. "
        'Pass e.g. skip="labels", skip=["labels", "meta.ids"] or skip=[("batch", 0)].'
    )


def test_a_skip_entry_that_is_no_key_says_what_to_pass() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        gk.to_device({"x": torch.ones(1)}, META, skip=["labels", None])
    assert str(caught.value) == (
        "skip entry None is neither a key, a dotted key path, nor a tuple path. "
        'Use "labels" (a key at any depth), "batch.meta.ids" or ("batch", 0).'
    )


def test_a_non_blocking_that_is_not_understood_says_what_to_pass() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        gk.to_device(torch.ones(1), META, non_blocking="yes")  # type: ignore[arg-type]
    assert str(caught.value) == (
        "non_blocking='yes' is not understood. Use True, False or \"auto\"."
    )
