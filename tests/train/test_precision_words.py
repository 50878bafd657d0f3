"""What the precision's choice and refusals say, read whole, and its CUDA branches with torch's
CUDA queries stood in for (no GPU needed): which device index is asked, what "auto" logs."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from gpukit.errors import DeviceError, InvalidArgumentError
from gpukit.train import precision as module
from gpukit.train.precision import Precision, autocast_forward, resolve_precision


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> dict[int, tuple[int, int]]:
    """CUDA's queries answered for two GPUs, cuda:1 the current one: an A100 (8.0) at index 0,
    a T4 (7.5) at index 1. A query of the wrong index answers for the other GPU."""
    capability = {0: (8, 0), 1: (7, 5)}
    names = {0: "NVIDIA A100", 1: "Tesla T4"}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capability[i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    return capability


def test_auto_on_a_gpu_asks_the_device_it_trains_on_and_says_why(
    two_gpus: dict[int, tuple[int, int]], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="gpukit.train"):
        assert resolve_precision("auto", torch.device("cuda", 0)).name == "bf16-mixed"
        assert resolve_precision("auto", torch.device("cuda")).name == "fp16-mixed"  # current: 1
    assert [r.getMessage() for r in caplog.records if r.name == "gpukit.train"] == [
        "precision='auto' chose 'bf16-mixed' on cuda:0: cuda:0 (NVIDIA A100, compute "
        "capability 8.0) computes bf16 natively",
        "precision='auto' chose 'fp16-mixed' on cuda: cuda:1 (Tesla T4, compute capability "
        "7.5) has no native bf16 (before 8.0)",
    ]


def test_bf16_on_a_gpu_without_it_is_refused_naming_the_gpu(
    two_gpus: dict[int, tuple[int, int]],
) -> None:
    assert resolve_precision("bf16-mixed", torch.device("cuda", 0)).dtype is torch.bfloat16
    with pytest.raises(DeviceError) as refused:
        resolve_precision("bf16-mixed", torch.device("cuda", 1))
    assert str(refused.value) == (
        "precision='bf16-mixed' was asked for on cuda:1 (Tesla T4, compute capability 7.5), "
        "which has no native bf16: it would be emulated, slower than fp32. Use "
        "precision='fp16-mixed' (with gpukit's gradient scaler) or 'auto'."
    )


@pytest.mark.parametrize(
    ("bf16", "text"),
    [
        (True, "chose 'bf16-mixed' on cpu: the CPU has bf16 instructions (AVX512-BF16 or AMX)"),
        (False, "chose 'fp32' on cpu: the CPU has no bf16 instructions (AVX512-BF16, AMX)"),
    ],
)
def test_auto_on_the_cpu_says_why_it_chose(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, bf16: bool, text: str
) -> None:
    monkeypatch.setattr(module, "cpu_has_native_bf16", lambda: bf16)
    with caplog.at_level(logging.INFO, logger="gpukit.train"):
        resolve_precision("auto", torch.device("cpu"))
    assert [r.getMessage() for r in caplog.records] == [f"precision='auto' {text}"]


def test_auto_on_another_device_says_why_it_chose_fp32(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="gpukit.train"):
        resolve_precision("auto", torch.device("meta"))
    assert [r.getMessage() for r in caplog.records] == [
        "precision='auto' chose 'fp32' on meta: mixed precision runs on CUDA GPUs and CPUs only"
    ]


def test_the_cpus_bf16_is_read_from_torchs_checks_a_missing_one_meaning_no(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert module.cpu_has_native_bf16() is False
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert module.cpu_has_native_bf16() is True


@pytest.mark.parametrize(
    ("request_", "device", "text"),
    [
        (
            "fp8",
            "cpu",
            "precision='fp8' is not a precision gpukit knows. Use one of 'auto', 'bf16-mixed', "
            "'fp16-mixed', 'fp32'.",
        ),
        (
            "fp16-mixed",
            "cpu",
            "precision='fp16-mixed' was asked for on the CPU, which has no fp16 autocast with a "
            "gradient scaler worth training with. Use precision='bf16-mixed' (fast on CPUs with "
            "AVX512-BF16 or AMX) or 'fp32', or 'auto' to let gpukit choose.",
        ),
        (
            "bf16-mixed",
            "meta",
            "precision='bf16-mixed' was asked for on a meta device; gpukit runs mixed precision "
            "on CUDA GPUs and CPUs only. Use precision='fp32' (or 'auto') on this device.",
        ),
    ],
)
def test_each_refused_precision_says_why_and_what_to_ask_for(
    request_: str, device: str, text: str
) -> None:
    with pytest.raises((InvalidArgumentError, DeviceError)) as refused:
        resolve_precision(request_, torch.device(device))
    assert str(refused.value) == text


class Keyword(nn.Module):
    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return torch.mm(x, x) * scale


def test_the_autocast_forward_passes_keywords_and_computes_in_the_precisions_dtype() -> None:
    model = Keyword()
    seen: list[torch.dtype] = []
    model.register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    autocast_forward(model, Precision("bf16-mixed", "cpu", torch.bfloat16))
    out = model(torch.ones(2, 2), scale=3.0)
    assert torch.equal(out, torch.full((2, 2), 6.0))
    assert out.dtype is torch.float32  # handed back as fp32


def test_preparing_again_restores_the_original_forward_before_wrapping_it() -> None:
    model = Keyword()
    bf16 = Precision("bf16-mixed", "cpu", torch.bfloat16)
    autocast_forward(model, bf16)
    autocast_forward(model, Precision("fp32", "cpu", None))
    assert "forward" not in vars(model)  # the class's own forward, as if never wrapped
    own = model.forward
    model.forward = lambda x, **kw: own(x, **kw) + 1  # type: ignore[method-assign]
    custom = model.forward
    autocast_forward(model, bf16)
    autocast_forward(model, Precision("fp32", "cpu", None))
    assert model.forward is custom  # a forward set by hand comes back as it was


def test_a_forward_borrowed_from_another_model_of_the_class_comes_back_as_it_was() -> None:
    model, other = Keyword(), Keyword()
    model.forward = other.forward  # type: ignore[method-assign]
    autocast_forward(model, Precision("bf16-mixed", "cpu", torch.bfloat16))
    autocast_forward(model, Precision("fp32", "cpu", None))
    assert model.forward.__self__ is other  # not the model's own forward
