"""Memory: what a device holds and who holds it, the peak of a block, freeing, batch sizes.

CUDA figures come from PyTorch's caching allocator (``torch.cuda.memory_stats``) and from the
driver (``torch.cuda.mem_get_info``, the numbers ``nvidia-smi --query-gpu=memory.free,
memory.total`` shows). The CPU has no caching allocator, so a CPU report gives the process's
resident set (``VmRSS`` / ``VmHWM`` in ``/proc/self/status``, what ``ps -o rss`` shows) and the
bytes held by the live tensors that Python's garbage collector can see.

The largest live tensors are found by walking ``gc.get_objects()``: tensors that only C++ holds
(saved for backward inside an autograd graph, for instance) are not seen. Each storage is
counted once, however many views share it.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import MutableMapping, MutableSequence, MutableSet
from dataclasses import dataclass, field
from typing import Any, TypeGuard, TypeVar

import torch
from torch import nn

from gpukit.devices import DeviceLike
from gpukit.devices import device as _parse_device
from gpukit.errors import InvalidArgumentError
from gpukit.memory.stats import cuda_stats, proc_memory
from gpukit.sizes import format_size

__all__ = ["FreedReport", "MemoryReport", "TensorInfo", "free_memory", "memory_report"]

SCHEMA = "gpukit.memory_report/1"
_T = TypeVar("_T")


@dataclass(frozen=True)
class TensorInfo:
    """One live tensor storage: its name where known, shape, dtype, device and size in bytes.

    Args:
        name: its parameter or buffer path (``"Net.fc.weight"``); None: not a module's.
        shape: the shape of the tensor seen, the view covering the most of the storage.
        dtype: its dtype without ``torch.`` (``"float32"``).
        device: its device (``"cuda:0"``).
        nbytes: the storage's size, in bytes.
    """

    name: str | None
    shape: tuple[int, ...]
    dtype: str
    device: str
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        """A plain dict for JSON output."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "device": self.device,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class MemoryReport:
    """Memory of one device, in bytes; ``None`` where the device cannot give a reading.

    Args:
        device: the device reported on (``"cuda:0"``, ``"cpu"``).
        allocated: bytes held by tensors (CUDA: the allocator's count; CPU: the distinct
            storages of the live tensors found).
        reserved: bytes the CUDA caching allocator holds from the driver (``None`` on CPU).
        peak: CUDA: peak ``allocated`` since start or the last reset; CPU: peak RSS.
        free: the device's free memory (CPU: available RAM).
        total: the device's total memory (CPU: total RAM).
        rss: this process's resident set size.
        tensors: the largest live tensors on the device, largest first; empty: none listed.
    """

    device: str
    allocated: int | None
    reserved: int | None
    peak: int | None
    free: int | None
    total: int | None
    rss: int | None
    tensors: tuple[TensorInfo, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        """A plain dict with a ``schema`` field, for ``gpukit info --json``."""
        return {
            "schema": SCHEMA,
            "device": self.device,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "peak": self.peak,
            "free": self.free,
            "total": self.total,
            "rss": self.rss,
            "tensors": [t.to_json() for t in self.tensors],
        }

    def __str__(self) -> str:
        rows = [
            ("allocated", self.allocated),
            ("reserved", self.reserved),
            ("peak", self.peak),
            ("free", self.free),
            ("total", self.total),
            ("process RSS", self.rss),
        ]
        lines = [f"memory on {self.device}"]
        lines += [f"  {label:<12} {_human(value):>10}" for label, value in rows]
        if self.tensors:
            lines.append(f"  largest live tensors ({len(self.tensors)}):")
            for t in self.tensors:
                shape = "x".join(map(str, t.shape)) or "scalar"
                lines.append(
                    f"    {_human(t.nbytes):>10}  {t.dtype:<9} {shape:<18} {t.name or '(unnamed)'}"
                )
        return "\n".join(lines)


def _human(n: int | None) -> str:
    return "n/a" if n is None else format_size(n)


def _is(obj: object, cls: type[_T]) -> TypeGuard[_T]:
    """``isinstance`` without reading ``obj.__class__``: scanning every object the garbage
    collector tracks meets proxies (deprecated torch.distributed names) that warn when read."""
    return issubclass(type(obj), cls)


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(data_ptr, nbytes) of a tensor's storage, or None when it has no real memory."""
    if t.device.type == "meta" or t.is_sparse or t.is_nested:
        return None
    try:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        return (storage.data_ptr(), nbytes) if nbytes else None
    except (RuntimeError, NotImplementedError):
        # A tensor subclass without a plain storage, or a wrapper whose storage is no memory
        # (a DTensor: its local shard, a tensor of its own, holds the bytes).
        return None


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s memory in this process: a DTensor's shard, else ``t``.

    No DTensor exists before its module is imported, so a report never imports it (the rule
    of ``checkpoint/dtensor.py``, a layer above this one)."""
    tensors = sys.modules.get("torch.distributed.tensor")
    if tensors is not None and _is(t, tensors.DTensor):
        local: torch.Tensor = t.to_local()
        return local
    return t


def _tensor_names(modules: list[nn.Module], *, prefixed: bool) -> dict[int, str]:
    """Storage data_ptr -> parameter or buffer name, for the given modules."""
    names: dict[int, str] = {}
    for module in modules:
        prefix = f"{type(module).__name__}." if prefixed else ""
        named = [*module.named_parameters(), *module.named_buffers()]
        for name, t in named:
            key = _storage_key(_local(t))
            if key is not None:
                names.setdefault(key[0], prefix + name)
    return names


def _root_modules(objects: list[object]) -> list[nn.Module]:
    """The live modules that are not a child of another live module."""
    modules = [o for o in objects if _is(o, nn.Module)]
    children = {id(c) for m in modules for c in m.children()}
    return [m for m in modules if id(m) not in children]


def _on(t: torch.Tensor, dev: torch.device) -> bool:
    if dev.type == "cuda":
        return t.device.type == "cuda" and t.device.index == dev.index
    return t.device.type == dev.type


def live_tensors(
    dev: torch.device, *, module: nn.Module | None = None
) -> tuple[list[TensorInfo], int]:
    """Every distinct live tensor storage on ``dev`` (largest first), and their total bytes."""
    objects = gc.get_objects()
    if module is not None:
        names = _tensor_names([module], prefixed=False)
    else:
        names = _tensor_names(_root_modules(objects), prefixed=True)
    seen: dict[int, TensorInfo] = {}
    for obj in objects:
        if not _is(obj, torch.Tensor) or not _on(obj, dev):
            continue
        key = _storage_key(obj)
        if key is None:
            continue
        ptr, nbytes = key
        known = seen.get(ptr)
        # Keep the view that covers the most of the storage, and the name once one is known.
        if known is None or (known.name is None and ptr in names):
            seen[ptr] = TensorInfo(
                name=names.get(ptr),
                shape=tuple(obj.shape),
                dtype=str(obj.dtype).removeprefix("torch."),
                device=str(obj.device),
                nbytes=nbytes,
            )
    infos = sorted(seen.values(), key=lambda i: -i.nbytes)
    return infos, sum(i.nbytes for i in infos)


def memory_report(
    device: DeviceLike | None = None, *, module: nn.Module | None = None, top: int = 10
) -> MemoryReport:
    """Memory of ``device`` (default: ``gk.device("auto")``) and its ``top`` largest tensors.

    Tensors are named by parameter or buffer path: relative to ``module`` when one is given,
    else as ``ClassName.path`` of every live top-level module.

    >>> print(memory_report("cpu", top=3))  # doctest: +SKIP
    memory on cpu
      allocated      48.0 MiB
      ...

    Args:
        device: the device to report on; None: ``gk.device("auto")``.
        module: a model whose tensors are named in the report, or None.
        top: how many of the largest tensors to list.
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise InvalidArgumentError(
            f"top={top!r} is not a count of tensors.", hint="Pass a whole number, 0 or more."
        )
    dev = _parse_device("auto" if device is None else device)
    infos, tensor_bytes = live_tensors(dev, module=module) if top else ([], None)
    proc = proc_memory()
    if dev.type == "cuda":
        stats = cuda_stats(dev)
        return MemoryReport(
            device=str(dev),
            allocated=stats.allocated,
            reserved=stats.reserved,
            peak=stats.peak,
            free=stats.free,
            total=stats.total,
            rss=proc.rss,
            tensors=tuple(infos[:top]),
        )
    if top == 0:
        _, tensor_bytes = live_tensors(dev, module=module)
    return MemoryReport(
        device=str(dev),
        allocated=tensor_bytes,
        reserved=None,
        peak=proc.peak_rss,
        free=proc.available if dev.type == "cpu" else None,
        total=proc.total if dev.type == "cpu" else None,
        rss=proc.rss,
        tensors=tuple(infos[:top]),
    )


@dataclass(frozen=True)
class FreedReport:
    """What ``free_memory`` released, in bytes.

    ``freed`` counts the tensor storages the objects held that nothing else still refers to;
    ``still_referenced`` those that some other live tensor keeps alive (another variable, an
    optimizer, a view). ``cuda_reserved_before`` / ``after`` show the CUDA caching allocator
    handing memory back to the driver, per device.

    Args:
        freed: bytes of the storages released that nothing else refers to.
        still_referenced: bytes of the storages that another live tensor keeps alive.
        cuda_reserved_before: bytes the CUDA caching allocator held, per device, before.
        cuda_reserved_after: the same, after; both empty when CUDA had not started.
    """

    freed: int
    still_referenced: int
    cuda_reserved_before: dict[str, int] = field(default_factory=dict)
    cuda_reserved_after: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        text = f"freed {_human(self.freed)} of tensors"
        if self.still_referenced:
            text += f" ({_human(self.still_referenced)} more is still referenced elsewhere)"
        for dev, before in self.cuda_reserved_before.items():
            after = self.cuda_reserved_after.get(dev)
            text += f"; {dev} reserved {_human(before)} -> {_human(after)}"
        return text


def _storages_of(obj: object, found: dict[tuple[str, int], int]) -> None:
    """Record (device, data_ptr) -> nbytes of every tensor storage ``obj`` holds directly."""
    tensors: list[torch.Tensor] = []
    if isinstance(obj, torch.Tensor):
        tensors = [obj]
    elif isinstance(obj, nn.Module):
        tensors = [*obj.parameters(), *obj.buffers()]
        tensors += [p.grad for p in obj.parameters() if p.grad is not None]
    elif isinstance(obj, torch.optim.Optimizer):
        tensors = [v for s in obj.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    elif isinstance(obj, MutableMapping):
        for v in obj.values():
            _storages_of(v, found)
    elif isinstance(obj, (MutableSequence, MutableSet)):
        for v in obj:
            _storages_of(v, found)
    for t in tensors:
        key = _storage_key(t)
        if key is not None:
            found[(str(t.device), key[0])] = key[1]


def _release(obj: object) -> None:
    if isinstance(obj, torch.Tensor):
        # set_() with no source drops this tensor's storage only: views and other tensors that
        # share it keep theirs.
        with torch.no_grad():
            obj.set_()  # type: ignore[call-overload]
        obj.grad = None
    elif isinstance(obj, nn.Module):
        for p in obj.parameters():
            p.grad = None
        # The meta device keeps shapes and dtypes (the module still prints and can be
        # re-materialised with .to_empty()) but holds no memory; the Parameter objects stay the
        # same, so an optimizer over them does not keep the old storage alive either.
        obj.to("meta")
    elif isinstance(obj, torch.optim.Optimizer):
        obj.state.clear()
    else:  # a container: checked by free_memory
        obj.clear()  # type: ignore[attr-defined]


def free_memory(*objs: object) -> FreedReport:
    """Release what ``objs`` hold, collect garbage, empty the CUDA cache; report what was freed.

    Each object is emptied in place, so its memory goes even while the caller's names still
    point at it: a tensor becomes an empty tensor, a module moves to the ``meta`` device
    (shapes kept, storage dropped), an optimizer forgets its state (moments restart at zero),
    and a dict, list or set is cleared. With no objects, it only collects and empties caches.

    >>> model, opt = torch.nn.Linear(1024, 1024), None
    >>> print(free_memory(model))  # doctest: +SKIP
    freed 4.0 MiB of tensors

    Args:
        *objs: the objects whose tensors to release (modules, optimizers, tensors, containers).
    """
    for obj in objs:
        if not isinstance(
            obj,
            (
                torch.Tensor,
                nn.Module,
                torch.optim.Optimizer,
                MutableMapping,
                MutableSequence,
                MutableSet,
            ),
        ):
            raise InvalidArgumentError(
                f"free_memory cannot release a {type(obj).__name__}: it holds no tensors that "
                "gpukit can drop.",
                hint="Pass tensors, modules, optimizers, or dicts, lists and sets of them.",
            )
    held: dict[tuple[str, int], int] = {}
    for obj in objs:
        _storages_of(obj, held)
    cuda_devices = (
        [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        else []
    )
    before = {str(d): torch.cuda.memory_reserved(d) for d in cuda_devices}
    for obj in objs:
        _release(obj)
    gc.collect()
    if cuda_devices:
        torch.cuda.empty_cache()
    after = {str(d): torch.cuda.memory_reserved(d) for d in cuda_devices}
    alive: set[tuple[str, int]] = set()
    if held:
        for o in gc.get_objects():
            if _is(o, torch.Tensor):
                key = _storage_key(o)
                if key is not None and (str(o.device), key[0]) in held:
                    alive.add((str(o.device), key[0]))
    return FreedReport(
        freed=sum(n for k, n in held.items() if k not in alive),
        still_referenced=sum(held[k] for k in alive),
        cuda_reserved_before=before,
        cuda_reserved_after=after,
    )
