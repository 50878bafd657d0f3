"""Devices: parse a device spec, choose one automatically, and see where a module lives.

Nothing here starts the CUDA driver. The driver reads ``CUDA_VISIBLE_DEVICES`` once, when it
starts, and ``torch.cuda.is_available()`` starts it (through ``cudaGetDeviceCount``) while
``torch.cuda.is_initialized()`` stays False. So devices are counted as torch does under
``PYTORCH_NVML_BASED_CUDA_CHECK=1``: through NVML, which honours ``CUDA_VISIBLE_DEVICES`` without
starting anything, falling back to CUDA's own count only where NVML is missing. That keeps
``gk.set_visible_devices`` working after these calls.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn

from gpukit.errors import DeviceError, MixedDevicesError

DeviceLike = torch.device | int | str

_SPEC = re.compile(r"^(?P<type>cpu|cuda|mps)(?::(?P<index>0|[1-9]\d*))?$")
# Any other device type torch knows ("meta", "xpu", "hpu", "privateuseone"...), with an index.
_OTHER = re.compile(r"^[a-z][a-z0-9_]*(?::(?:0|[1-9]\d{0,8}))?$")
_SUGGESTIONS = {
    "gpu": "cuda",
    "gpu:0": "cuda:0",
    "nvidia": "cuda",
    "metal": "mps",
    "apple": "mps",
    "host": "cpu",
}

__all__ = [
    "DeviceLike",
    "cuda_device_count",
    "device",
    "device_list",
    "module_device",
    "placement",
    "try_all_gpus",
    "try_gpu",
]


def cuda_device_count() -> int:
    """How many CUDA devices this process sees, without starting the CUDA driver.

    ``torch.cuda.device_count()`` asks NVML first and calls ``cudaGetDeviceCount`` (which starts
    the driver) only where NVML cannot answer; ``torch.cuda.is_available()`` would start it
    every time. As with ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, a GPU that NVML sees but CUDA
    cannot use (a driver too old for this torch) is counted, and fails on first use instead.
    """
    return int(torch.cuda.device_count())


_cuda_count = cuda_device_count


def cuda_initialized() -> bool:
    """Whether torch has set CUDA up in this process, so that asking torch about the current
    device or the CUDA random states starts nothing: :func:`gpukit.gpus.visible.cuda_started`
    with ``by_torch=True`` (never starts it)."""
    from gpukit.gpus.visible import cuda_started

    return cuda_started(by_torch=True)


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _visible_summary() -> str:
    """Describe the CUDA devices this process sees, for error messages."""
    count = _cuda_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    env_text = "CUDA_VISIBLE_DEVICES is not set" if env is None else f"CUDA_VISIBLE_DEVICES={env}"
    if count == 0:
        built = "torch built with CUDA" if torch.version.cuda else "torch built without CUDA"
        return f"this process sees no CUDA devices ({env_text}; {built})"
    names = ", ".join(f"cuda:{i}" for i in range(count))
    plural = "device" if count == 1 else "devices"
    return f"this process sees {count} CUDA {plural} ({names}; {env_text})"


def _check_cuda_index(index: int, spec: object) -> None:
    count = _cuda_count()
    if not 0 <= index < count:
        hint = (
            'Use one of those, or gk.device("auto").'
            if count
            else 'Use "cpu", or gk.device("auto") to fall back to the CPU.'
        )
        raise DeviceError(f"{spec} is not visible: {_visible_summary()}.", hint=hint)


def _auto() -> torch.device:
    if _cuda_count() > 0:
        return torch.device("cuda", 0)
    if _mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def _validated(dev: torch.device, spec: object) -> torch.device:
    if dev.type == "cuda":
        index: int | None = dev.index
        if index is None:
            index = torch.cuda.current_device() if cuda_initialized() else 0
        _check_cuda_index(index, spec)
        return torch.device("cuda", index)
    if dev.type == "mps" and not _mps_available():
        raise DeviceError(
            f"{spec} was asked for, but MPS (Apple's Metal backend) is not available here.",
            hint='Use gk.device("auto") to pick the best device this machine has.',
        )
    return dev


def device(spec: DeviceLike = "auto") -> torch.device:
    """Turn a device spec into a checked ``torch.device``.

    ``spec`` is a ``torch.device``, a CUDA index (``1``), or one of ``"cpu"``, ``"cuda"``,
    ``"cuda:N"``, ``"mps"`` and ``"auto"``. ``"auto"`` is ``cuda:0`` when a CUDA device is
    visible, else ``mps`` when available, else ``cpu``. ``"cuda"`` means the current CUDA device
    (``cuda:0`` before CUDA starts), always returned with its index. Any other device type torch
    accepts (``"meta"``, ``"xpu"``, ``"hpu"``, ``"privateuseone"``...) is passed through as
    torch reads it, unchecked, as it is for a ``torch.device`` of that type.

    Raises :class:`~gpukit.errors.DeviceError` for unknown names and for devices this process
    cannot see, listing the ones it can.

    >>> device("cpu")
    device(type='cpu')

    Args:
        spec: ``"auto"`` (the default), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"``, an
            index N, or a ``torch.device``.
    """
    if isinstance(spec, torch.device):
        return _validated(spec, f"{spec}")
    if isinstance(spec, bool):  # bool is an int subclass; True is not a device
        raise DeviceError(f"{spec!r} is not a device.", hint='Pass an index, "cpu" or "auto".')
    if isinstance(spec, int):
        if spec < 0:
            raise DeviceError(f"CUDA device index {spec} is negative.", hint="Indices start at 0.")
        _check_cuda_index(spec, f"cuda:{spec}")
        return torch.device("cuda", spec)
    if not isinstance(spec, str):
        raise DeviceError(
            f"{spec!r} (a {type(spec).__name__}) is not a device spec.",
            hint='Pass a torch.device, an int, or one of "cpu", "cuda", "cuda:N", "mps", "auto".',
        )
    if spec == "auto":
        return _auto()
    match = _SPEC.match(spec)
    if match is None and _OTHER.match(spec):
        other = _other_device(spec)
        if other is not None:
            return other
    if match is None or (match["type"] != "cuda" and match["index"] not in (None, "0")):
        cleaned = spec.strip().lower()
        suggestion = _SUGGESTIONS.get(cleaned) or (
            cleaned if cleaned != spec and _SPEC.match(cleaned) else None
        )
        hint = f'Did you mean "{suggestion}"? ' if suggestion else ""
        raise DeviceError(
            f"{spec!r} is not a device spec.",
            hint=hint + 'Use "cpu", "cuda", "cuda:N", "mps", or "auto".',
        )
    if match["type"] == "cuda" and match["index"] is not None:
        # Checked before torch parses it: torch refuses indices past 64 bits with a RuntimeError.
        index = int(match["index"])
        _check_cuda_index(index, spec)
        return torch.device("cuda", index)
    return _validated(torch.device(spec), spec)


def _other_device(spec: str) -> torch.device | None:
    """A device of a type gpukit does not check itself ("meta", "xpu"...), as torch reads it."""
    try:
        dev = torch.device(spec)
    except RuntimeError:  # not a device type torch knows
        return None
    return None if dev.type in ("cpu", "cuda", "mps") else dev


def device_list(specs: Sequence[DeviceLike], *, what: str = "devices") -> list[torch.device]:
    """Parse a list of device specs (``["cpu"] * 4``, ``[0, 1]``) with :func:`device`.

    A bare string or device is refused rather than read one character at a time.

    Args:
        specs: the device specs, each one :func:`device` takes; a bare str, device or int is
            refused (:class:`~gpukit.errors.DeviceError`).
        what: what the list is, for the message (``"devices"``).
    """
    if isinstance(specs, (str, torch.device, int)):
        raise DeviceError(
            f"{what} must be a list of devices, not the single value {specs!r}.",
            hint=f"Pass a list, for example [{specs!r}] or [{specs!r}] * 2.",
        )
    return [device(spec) for spec in specs]


def try_gpu(i: int = 0) -> torch.device:
    """Return ``cuda:i`` if that GPU is visible, else the CPU.

    >>> try_gpu(7) if not __import__("torch").cuda.is_available() else None
    device(type='cpu')

    Args:
        i: the CUDA index wanted, 0 or more.
    """
    if isinstance(i, bool) or not isinstance(i, int):
        raise DeviceError(
            f"try_gpu({i!r}): a GPU index is a whole number, not a {type(i).__name__}.",
            hint='Pass 0 for the first GPU, 1 for the second; for a name use gk.device("cuda:1").',
        )
    if i < 0:
        raise DeviceError(f"try_gpu({i}): GPU indices start at 0.", hint="Pass 0 or more.")
    if i < _cuda_count():
        return torch.device("cuda", i)
    return torch.device("cpu")


def try_all_gpus() -> list[torch.device]:
    """Return every visible CUDA device, or ``[cpu]`` when there is none."""
    count = _cuda_count()
    return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]


def placement(module: nn.Module) -> dict[torch.device, list[str]]:
    """Group a module's parameter and buffer names by the device they are on.

    >>> placement(torch.nn.Linear(2, 2))
    {device(type='cpu'): ['weight', 'bias']}

    Args:
        module: the module to look at.
    """
    groups: defaultdict[torch.device, list[str]] = defaultdict(list)
    for name, param in module.named_parameters():
        groups[param.device].append(name)
    for name, buffer in module.named_buffers():
        groups[buffer.device].append(name)
    return dict(groups)


def module_device(module: nn.Module) -> torch.device:
    """The one device a module's parameters and buffers are on.

    A module with neither (``nn.ReLU()``) is on the CPU. Raises
    :class:`~gpukit.errors.MixedDevicesError` naming which tensors sit where when they disagree.

    Args:
        module: the module to look at.
    """
    groups = placement(module)
    if not groups:
        return torch.device("cpu")
    if len(groups) == 1:
        return next(iter(groups))
    parts = []
    for dev, names in sorted(groups.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(names[:3]) + (f", and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"{dev}: {shown}")
    raise MixedDevicesError(
        f"{type(module).__name__} has parameters and buffers on {len(groups)} devices ("
        + "; ".join(parts)
        + ").",
        hint="Move the whole module with module.to(device), or use gk.placement(module) "
        "to see every name.",
    )
