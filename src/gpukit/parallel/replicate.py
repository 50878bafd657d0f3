"""Copies of a module, one per device, tied to the original by autograd: ``gk.parallel.replicate``.

A replica is a shallow structural copy of every submodule (``Module._replicate_for_data_parallel``,
which modules such as RNNs override) whose parameters are *differentiable copies* of the
original ones: ``p.to(device)``, or ``p`` itself on the same device. Gradients of a loss
computed from any replica therefore land in the original parameters' ``.grad``. Buffers are
always copied, so that in-place updates in forward (BatchNorm's running statistics) stay on
the replica instead of racing on the original.

The structure is built once per (module, devices, thread) and kept; each call only refreshes
parameters and buffers. It is rebuilt when the module's tree changes (a submodule added,
removed or replaced), when any submodule's own attributes change (``train()``/``eval()``,
a new hook dict, a plain attribute reassigned), or when the devices change. Caches are kept
per thread, so threads never share replicas, and weakly per module, so they go with it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import gpukit.parallel._cuda as _cuda
from gpukit.devices import DeviceLike, device_list
from gpukit.errors import InvalidArgumentError

__all__ = ["replicate"]

_MISSING = object()
# Where a replica records its device, for parallel_apply's error messages.
REPLICA_DEVICE_ATTR = "_gpukit_replica_device"


def _snapshot(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    return tuple(module.__dict__.items())


def _unchanged(module: nn.Module, snapshot: tuple[tuple[str, Any], ...]) -> bool:
    return _same_state(module.__dict__, snapshot)


def _same_state(state: dict[str, Any], expected: Any) -> bool:
    """Whether ``state`` holds exactly the keys and (by identity: values may be tensors) values."""
    items = expected.items() if isinstance(expected, dict) else expected
    if len(state) != len(expected):
        return False
    return all(state.get(key, _MISSING) is value for key, value in items)


class _ReplicaSet:
    """The replicas of one module for one list of devices, and how to refresh them."""

    def __init__(self, root: nn.Module, devices: tuple[torch.device, ...]) -> None:
        self.devices = devices
        named = list(root.named_modules())
        self._names = [name for name, _ in named]
        # Snapshots hold the attribute values (not the modules), so no module id they cover
        # can be reused by another object while the set lives, and the root is never kept
        # alive by its own cache entry.
        self._snapshots = [_snapshot(module) for _, module in named]
        index = {id(module): i for i, (_, module) in enumerate(named)}
        self.replicas: list[list[nn.Module]] = []  # [device][module position]
        self._pristine: list[list[dict[str, Any]]] = []
        for dev in devices:
            copies = [module._replicate_for_data_parallel() for _, module in named]
            for (_, module), replica in zip(named, copies, strict=True):
                for key, child in module._modules.items():
                    replica._modules[key] = None if child is None else copies[index[id(child)]]
                replica.__dict__[REPLICA_DEVICE_ATTR] = dev
            self.replicas.append(copies)
            self._pristine.append([dict(replica.__dict__) for replica in copies])
        self._keys = tuple((name, id(module)) for name, module in named)

    def matches(self, root: nn.Module) -> bool:
        """Whether ``root`` still has the tree and attributes these replicas were built from."""
        position = 0
        snapshots = self._snapshots
        for name, module in root.named_modules():
            if position >= len(self._keys) or self._keys[position] != (name, id(module)):
                return False
            if not _unchanged(module, snapshots[position]):
                return False
            position += 1
        return position == len(self._keys)

    def release(self, count: int | None = None) -> None:
        """Drop every per-step tensor the replicas hold, and whatever their forward stored."""
        for copies, pristine in zip(self.replicas[:count], self._pristine[:count], strict=True):
            for replica, state in zip(copies, pristine, strict=True):
                replica._parameters.clear()
                replica._buffers.clear()
                if not _same_state(replica.__dict__, state):
                    replica.__dict__.clear()
                    replica.__dict__.update(state)

    def refresh(self, root: nn.Module, count: int | None = None) -> list[nn.Module]:
        """Point the first ``count`` replicas at fresh copies of ``root``'s parameters, buffers."""
        modules = [module for _, module in root.named_modules()]
        devices = self.devices[:count]
        memos = _broadcast_all(modules, devices)
        for dev_index, dev in enumerate(devices):
            copies = self.replicas[dev_index]
            # One copy per tensor, so tied parameters stay tied in the replica.
            memo: dict[int, torch.Tensor] = memos[dev_index]
            for module, replica in zip(modules, copies, strict=True):
                for key, param in module._parameters.items():
                    # setattr, not the dict: RNNs keep their flat weight list in step with it.
                    setattr(replica, key, None if param is None else _copy(param, dev, memo))
                for key, buf in module._buffers.items():
                    replica._buffers[key] = None if buf is None else _copy_buffer(buf, dev, memo)
        return [copies[0] for copies in self.replicas[: len(devices)]]


def _broadcast_all(
    modules: list[nn.Module], devices: Sequence[torch.device]
) -> list[dict[int, torch.Tensor]]:
    """Per device, id(tensor) -> its copy there, made in coalesced broadcasts on distinct GPUs.

    Empty memos (so that each tensor is copied on its own) on CPU, repeated devices, a module
    spread over devices, or a target that is the module's own device.
    """
    memos: list[dict[int, torch.Tensor]] = [{} for _ in devices]
    targets = _cuda.cuda_indices(devices)
    if targets is None:
        return memos
    unique: dict[int, torch.Tensor] = {}
    for module in modules:
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None:
                unique.setdefault(id(tensor), tensor)
    tensors = list(unique.values())
    if not tensors or tensors[0].device.type != "cuda":
        return memos
    source = tensors[0].device.index
    if source is None or source in targets:
        return memos
    copies = _cuda.broadcast(tensors, source, targets)
    if copies is None:
        return memos
    for memo, per_device in zip(memos, copies, strict=True):
        memo.update(zip(unique, per_device, strict=True))
    return memos


def _copy(tensor: torch.Tensor, dev: torch.device, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    if tensor.device == dev:
        # The original itself: gradients and in-place updates go straight to it.
        return tensor
    found = memo.get(id(tensor))
    if found is None:
        # A differentiable copy when the tensor requires grad; a plain one (no graph) otherwise.
        found = memo[id(tensor)] = tensor.to(dev)
    return found


def _copy_buffer(
    buffer: torch.Tensor, dev: torch.device, memo: dict[int, torch.Tensor]
) -> torch.Tensor:
    # Always a copy, even on the original's device: forward updates buffers in place (BatchNorm's
    # running statistics), and replicas sharing the original's buffers would race on them.
    found = memo.get(id(buffer))
    if found is None:
        found = memo[id(buffer)] = buffer.to(dev) if buffer.device != dev else buffer.clone()
    return found


_LOCAL = threading.local()


def _cache() -> weakref.WeakKeyDictionary[nn.Module, _ReplicaSet]:
    cache: weakref.WeakKeyDictionary[nn.Module, _ReplicaSet] | None = getattr(_LOCAL, "cache", None)
    if cache is None:
        cache = _LOCAL.cache = weakref.WeakKeyDictionary()
    return cache


def replica_set(module: nn.Module, devices: Sequence[DeviceLike]) -> _ReplicaSet:
    """This thread's cached replicas of ``module`` on ``devices``, rebuilt if out of date."""
    targets = tuple(device_list(devices))
    cache = _cache()
    found = cache.get(module)
    if found is None or found.devices != targets or not found.matches(module):
        found = cache[module] = _ReplicaSet(module, targets)
    return found


def replicate(module: nn.Module, devices: Sequence[DeviceLike]) -> list[nn.Module]:
    """One copy of ``module`` per device, whose parameters are tied to the original by autograd.

    Gradients of anything computed with a replica flow back to ``module``'s own parameters.
    The copies are built once and reused: each call refreshes their parameters and buffers
    (and drops whatever the previous step left on them, so no autograd graph outlives it), and
    rebuilds them only when the module's structure or ``devices`` changed. Replicas are
    per thread, and valid until the next ``replicate`` of the same module in that thread.

    Warning: replicas hold no ``nn.Parameter`` of their own on other devices (their parameters
    are plain tensors), so ``replica.parameters()`` is not a way to reach the weights; and
    updates a replica makes to its own state in forward are lost at the next call.

    >>> import torch
    >>> net = torch.nn.Linear(3, 1)
    >>> a, b = replicate(net, ["cpu", "cpu"])
    >>> (a(torch.ones(1, 3)) + b(torch.ones(1, 3))).sum().backward()
    >>> net.weight.grad
    tensor([[2., 2., 2.]])

    Args:
        module: the module to copy.
        devices: one device per copy, repeats allowed.
    """
    if len(devices) == 0:
        raise InvalidArgumentError(
            "replicate was given no devices.", hint='Pass at least one, for example ["cpu"].'
        )
    replicas = replica_set(module, devices)
    replicas.release()
    return replicas.refresh(module)
