"""Run replicas at once, one thread each: ``gk.parallel.parallel_apply``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gpukit.devices import DeviceLike
from gpukit.devices import device as _parse_device
from gpukit.errors import InvalidArgumentError, ReplicaError
from gpukit.parallel.replicate import REPLICA_DEVICE_ATTR

__all__ = ["parallel_apply"]


def _device_of(replica: nn.Module) -> torch.device | None:
    dev = replica.__dict__.get(REPLICA_DEVICE_ATTR)
    if isinstance(dev, torch.device):
        return dev
    for tensor in (*replica.parameters(), *replica.buffers()):
        return tensor.device
    return None


class _CallerState:
    """The thread-local torch modes of the calling thread, to be re-entered in each worker.

    Grad mode, inference mode and autocast are per thread in PyTorch: a worker thread starts
    with grad on and autocast off, whatever the caller chose.
    """

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [
            (kind, torch.get_autocast_dtype(kind))
            for kind in ("cpu", "cuda")
            if torch.is_autocast_enabled(kind)
        ]

    @contextlib.contextmanager
    def entered(self, dev: torch.device | None) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad))
            if self.inference:
                stack.enter_context(torch.inference_mode())
            for kind, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            if dev is not None and dev.type == "cuda":
                stack.enter_context(torch.cuda.device(dev))
            yield


def parallel_apply(
    replicas: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    kwargs: Sequence[Mapping[str, Any] | None] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
) -> list[Any]:
    """Call ``replicas[i](*inputs[i], **kwargs[i])`` for every i at once, one thread per replica.

    An ``inputs`` entry that is not a tuple is passed as the only argument. The caller's grad
    mode, inference mode and autocast settings hold in every thread. An exception in a replica
    is raised here as :class:`~gpukit.errors.ReplicaError` naming the replica and its device,
    with the original exception as its ``__cause__``. ``devices`` is only needed to name the
    devices of replicas that ``replicate`` did not make.

    >>> import torch
    >>> nets = [torch.nn.Identity(), torch.nn.Identity()]
    >>> parallel_apply(nets, [torch.zeros(1), (torch.ones(1),)])
    [tensor([0.]), tensor([1.])]

    Args:
        replicas: the callables, one per device.
        inputs: each replica's positional inputs (a tuple, or one value).
        kwargs: each replica's keyword inputs, or None.
        devices: each replica's device, made the current CUDA device in its thread and named in
            errors; None: the device each ``nn.Module`` replica is on.
    """
    count = len(replicas)
    if len(inputs) != count or (kwargs is not None and len(kwargs) != count):
        raise InvalidArgumentError(
            f"parallel_apply got {count} replicas, {len(inputs)} inputs and "
            f"{'no' if kwargs is None else len(kwargs)} kwargs.",
            hint="Pass one inputs entry (and one kwargs entry, if any) per replica; "
            "scatter may return fewer chunks than devices, so run replicas[: len(chunks)].",
        )
    if devices is not None and len(devices) != count:
        raise InvalidArgumentError(
            f"parallel_apply got {count} replicas but {len(devices)} devices.",
            hint="Pass one device per replica, or none.",
        )
    targets = [
        _parse_device(d) if d is not None else None
        for d in (devices if devices is not None else [None] * count)
    ]
    targets = [
        t if t is not None or not isinstance(r, nn.Module) else _device_of(r)
        for t, r in zip(targets, replicas, strict=True)
    ]
    results: list[Any] = [None] * count
    errors: dict[int, BaseException] = {}
    state = _CallerState()

    def work(index: int) -> None:
        args = inputs[index]
        if not isinstance(args, tuple):
            args = (args,)
        extra = kwargs[index] if kwargs is not None else None
        try:
            with state.entered(targets[index]):
                results[index] = replicas[index](*args, **(extra or {}))
        except Exception as exc:  # re-raised in the caller below, with the device named
            errors[index] = exc

    if count == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(1, count)]
        for thread in threads:
            thread.start()
        work(0)  # the caller's thread does its share rather than wait idle
        for thread in threads:
            thread.join()
    if errors:
        index = min(errors)
        exc = errors[index]
        where = targets[index] if targets[index] is not None else "an unknown device"
        n = len(errors) - 1
        others = f" ({n} other replica{'s' * (n != 1)} failed too)" if n else ""
        raise ReplicaError(
            f"replica {index} of {count} on {where} raised {type(exc).__name__}: {exc}{others}.",
            hint="The original traceback follows as the cause; run the module on that "
            "replica's chunk alone to debug it.",
        ) from exc
    return results
