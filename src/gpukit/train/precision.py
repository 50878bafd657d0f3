"""Mixed precision that is honest about the device: what runs in bf16 or fp16, and the refusals.

``resolve_precision("auto", device)`` picks, from what the device does natively:

- a CUDA GPU of compute capability 8.0 or later (Ampere and up): bf16 autocast;
- an older CUDA GPU: fp16 autocast with a gradient scaler. ``torch.cuda.is_bf16_supported()``
  answers True on such GPUs (V100, T4) because bf16 can be *emulated* there
  (pytorch/pytorch#148322), slower than fp32, so the capability decides, not that call;
- a CPU: bf16 autocast where the CPU has bf16 instructions (AVX512-BF16 or AMX), fp32 on the
  others. ``gpukit bench --only train`` measures the bf16 step against fp32 (docs/benchmarks.md):
  faster with the instructions, several times slower without them (pytorch/pytorch#118499);
- any other device: fp32.

What ``"auto"`` chose is logged once per resolution (logger ``gpukit.train``, INFO) and is the
``name`` of the :class:`Precision` returned: ``loader.precision.name`` for a prepared loader,
``train_step.precision.name`` for a training step.

A request the device cannot honour (fp16 on a CPU, bf16 on a GPU before Ampere) is a
:class:`~gpukit.errors.DeviceError` naming the device and what to ask for instead; nothing falls
back to fp32 silently. Autocast changes the compute dtype of the forward only: the weights, the
optimizer state and the gradients (and so their all-reduce) stay fp32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from gpukit._tree import mapper
from gpukit.errors import DeviceError, InvalidArgumentError

__all__ = [
    "PRECISIONS",
    "AutocastForward",
    "Precision",
    "autocast_forward",
    "cpu_has_native_bf16",
    "resolve_precision",
]

PRECISIONS = ("auto", "bf16-mixed", "fp16-mixed", "fp32")

log = logging.getLogger("gpukit.train")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX), as oneDNN uses it.

    The figure behind "auto" (docs/benchmarks.md, "The training step"): on a CPU with
    AVX512-BF16 a bf16 autocast step took 0.30x to 0.91x the fp32 step; with oneDNN held to
    AVX-512 without BF16, 1.3x to 1.8x, and to AVX2, 4.2x. Other CPUs (ARM) are not measured:
    fp32 there.
    """
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


@dataclass(frozen=True)
class Precision:
    """A resolved precision: the autocast dtype (None for fp32) and whether a scaler is needed.

    Args:
        name: ``"fp32"``, ``"bf16-mixed"`` or ``"fp16-mixed"`` (what ``"auto"`` resolved to).
        device_type: the autocast device type (``"cuda"``, ``"cpu"``, ``"mps"``).
        dtype: the autocast dtype (``torch.bfloat16``, ``torch.float16``); None: fp32.
    """

    name: str
    device_type: str
    dtype: torch.dtype | None

    @property
    def scaled(self) -> bool:
        """Whether gradients need a loss scaler (fp16: small gradients underflow otherwise)."""
        return self.dtype == torch.float16

    @property
    def mixed(self) -> bool:
        """Whether the forward runs under autocast."""
        return self.dtype is not None


def _cuda_name(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return f"cuda:{index} ({torch.cuda.get_device_name(index)}, compute capability {major}.{minor})"


def _native_bf16(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _check_request(request: object) -> str:
    if not isinstance(request, str) or request not in PRECISIONS:
        raise InvalidArgumentError(
            f"precision={request!r} is not a precision gpukit knows.",
            hint="Use one of " + ", ".join(repr(p) for p in PRECISIONS) + ".",
        )
    return request


def _auto(device: torch.device) -> tuple[str, str]:
    """What ``"auto"`` picks on ``device``, and why, in words for the log."""
    if device.type == "cuda":
        if _native_bf16(device):
            return "bf16-mixed", f"{_cuda_name(device)} computes bf16 natively"
        return "fp16-mixed", f"{_cuda_name(device)} has no native bf16 (before 8.0)"
    if device.type == "cpu":
        if cpu_has_native_bf16():
            return "bf16-mixed", "the CPU has bf16 instructions (AVX512-BF16 or AMX)"
        return "fp32", "the CPU has no bf16 instructions (AVX512-BF16, AMX)"
    return "fp32", "mixed precision runs on CUDA GPUs and CPUs only"


def resolve_precision(request: object, device: torch.device) -> Precision:
    """The precision to train with on ``device``: ``"auto"`` decided, an impossible one refused.

    >>> resolve_precision("fp32", torch.device("cpu")).dtype is None
    True

    ``"auto"`` logs what it chose and why (logger ``gpukit.train``, INFO).

    Args:
        request: a name of :data:`PRECISIONS` ("auto", "bf16-mixed", "fp16-mixed", "fp32").
        device: the device the model trains on.

    Raises:
        InvalidArgumentError: ``request`` is not one of :data:`PRECISIONS`.
        DeviceError: the device cannot run the request natively (fp16 on a CPU, bf16 on a CUDA
            GPU older than compute capability 8.0, mixed precision on another device type).
    """
    name = _check_request(request)
    kind = device.type
    if name == "auto":
        name, why = _auto(device)
        log.info("precision='auto' chose %r on %s: %s", name, device, why)
    if name == "fp32":
        return Precision("fp32", kind, None)
    if kind == "cpu" and name == "fp16-mixed":
        raise DeviceError(
            "precision='fp16-mixed' was asked for on the CPU, which has no fp16 autocast with "
            "a gradient scaler worth training with.",
            hint="Use precision='bf16-mixed' (fast on CPUs with AVX512-BF16 or AMX) or 'fp32', "
            "or 'auto' to let gpukit choose.",
        )
    if kind == "cuda" and name == "bf16-mixed" and not _native_bf16(device):
        raise DeviceError(
            f"precision='bf16-mixed' was asked for on {_cuda_name(device)}, which has no native "
            "bf16: it would be emulated, slower than fp32.",
            hint="Use precision='fp16-mixed' (with gpukit's gradient scaler) or 'auto'.",
        )
    if kind not in ("cpu", "cuda"):
        raise DeviceError(
            f"precision={name!r} was asked for on a {kind} device; gpukit runs mixed precision "
            "on CUDA GPUs and CPUs only.",
            hint="Use precision='fp32' (or 'auto') on this device.",
        )
    return Precision(name, kind, _DTYPES[name])


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.float()
    return tensor


_OUTPUTS_TO_FP32 = mapper(_to_fp32, torch.Tensor)


class AutocastForward:
    """A module's forward run under autocast, its bf16/fp16 outputs handed back as fp32.

    The loss is then computed in fp32 outside autocast, as in a plain script. An object, not a
    closure, so a model carrying it still pickles.
    """

    def __init__(self, forward: Any, precision: Precision) -> None:
        self.forward = forward
        self.precision = precision

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.precision.device_type, dtype=self.precision.dtype):
            out = self.forward(*args, **kwargs)
        return _OUTPUTS_TO_FP32(out)


def autocast_forward(model: torch.nn.Module, precision: Precision) -> torch.nn.Module:
    """Make ``model(x)`` run under ``precision``'s autocast (in place); fp32 leaves it as it is.

    The weights are not cast: they stay fp32 master weights, and so do their gradients.
    """
    current = vars(model).get("forward")
    if isinstance(current, AutocastForward):  # prepared before: start from the forward it ran
        original = current.forward
        if getattr(original, "__self__", None) is model and getattr(
            original, "__func__", None
        ) is getattr(type(model), "forward", None):
            del model.forward  # the class's own forward again, as if never wrapped
        else:
            model.forward = original
    if precision.mixed:
        model.forward = AutocastForward(model.forward, precision)
    return model
