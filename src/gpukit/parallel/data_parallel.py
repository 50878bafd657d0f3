"""Single-process data parallelism over several devices: ``gk.DataParallel``."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn

from gpukit.devices import DeviceLike, device_list, module_device, try_all_gpus
from gpukit.devices import device as _parse_device
from gpukit.errors import DeviceError, InvalidArgumentError
from gpukit.parallel.apply import parallel_apply
from gpukit.parallel.gather import gather_on
from gpukit.parallel.replicate import replica_set
from gpukit.parallel.scatter import scatter
from gpukit.transfer import mover

__all__ = ["DataParallel"]


class DataParallel(nn.Module):
    """Split each batch over devices, run a replica of ``module`` on each, gather the outputs.

    The constructor and forward contract are those of ``torch.nn.DataParallel``:
    ``device_ids`` defaults to every visible CUDA device (the CPU on a machine without one),
    and may repeat a device, such as ``["cpu"] * 4``; outputs are gathered on
    ``output_device`` (default ``device_ids[0]``); the module's parameters and buffers must be
    on ``device_ids[0]``; ``.module`` is the wrapped module, and the state dict keys carry the
    ``module.`` prefix (``gk.save`` and ``gk.load`` remove it).

    What it does differently: a batch of 9 on 4 devices runs as 3, 2, 2, 2 (never an empty or
    missing replica; fewer replicas run when there are fewer samples than devices, and
    ``min_chunk`` keeps chunks at least that large, for BatchNorm); replicas are built once
    and reused across steps; any output structure (dicts, dataclasses, namedtuples, scalars)
    is gathered; an error in a replica names its device; and it runs on CPU-only machines.
    On distinct CUDA devices, parameters and buffers are broadcast in coalesced buckets and
    inputs and outputs are scattered and gathered with ``torch.nn.parallel.comm``, as
    ``nn.DataParallel`` does; CPU replicas and repeated devices copy tensor by tensor.

    Warning: this is one process with one thread per device, so Python code in ``forward``
    runs one replica at a time (the GIL). Updates that ``forward`` makes to the module's state
    (attributes, or buffers such as BatchNorm's running statistics) survive only from the
    replica on ``device_ids[0]``, which is the wrapped module itself; those on other replicas
    are lost, as with ``nn.DataParallel``. Plain tensor attributes that are neither
    parameters nor buffers are shared, not moved. For one process per GPU, which scales
    better, use ``gk.distributed``.

    >>> import torch
    >>> net = DataParallel(torch.nn.Linear(4, 2), device_ids=["cpu"] * 4)
    >>> net(torch.randn(9, 4)).shape
    torch.Size([9, 2])

    Args:
        module: the module to run on every device; its parameters on ``device_ids[0]``.
        device_ids: the devices to split each batch over, repeats allowed (``["cpu"] * 4``);
            None: every visible CUDA device, else the CPU.
        output_device: where the outputs are gathered; None: ``device_ids[0]``.
        dim: the dimension of the inputs split into chunks (0: the batch).
        min_chunk: the fewest samples a replica gets, 1 or more (for BatchNorm).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        min_chunk: int = 1,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise InvalidArgumentError(
                f"DataParallel wraps a module (an nn.Module), and was given a "
                f"{type(module).__name__}: {module!r:.60}.",
                hint="Pass the model itself, e.g. gk.DataParallel(model, device_ids=['cpu'] * 2); "
                "a function can be wrapped in an nn.Module whose forward calls it.",
            )
        for name, value in (("dim", dim), ("min_chunk", min_chunk)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(
                    f"DataParallel({name}={value!r}): {name} is a whole number, not a "
                    f"{type(value).__name__}.",
                    hint="dim=0 splits batches along their first dimension; min_chunk=1 is "
                    "the default.",
                )
        if device_ids is None:
            devices = try_all_gpus()
        else:
            devices = device_list(device_ids, what="device_ids")
            if not devices:
                raise InvalidArgumentError(
                    "DataParallel was given an empty device_ids.",
                    hint='Leave it out to use every visible GPU, or pass e.g. ["cpu"] * 2.',
                )
        if min_chunk < 1:
            raise InvalidArgumentError(
                f"min_chunk={min_chunk} is below 1.", hint="Use 1 (the default) or more."
            )
        self.module = module
        self.device_ids: list[torch.device] = devices
        self.output_device = devices[0] if output_device is None else _parse_device(output_device)
        self.dim = dim
        self.min_chunk = min_chunk
        home = module_device(module)
        if home != devices[0] and any(True for _ in chain(module.parameters(), module.buffers())):
            raise DeviceError(
                f"DataParallel needs the module on device_ids[0] ({devices[0]}), but its "
                f"parameters and buffers are on {home}.",
                hint=f'Move it first: module.to("{devices[0]}"), or list {home} first in '
                "device_ids.",
            )

    def _check_placement(self) -> None:
        # Only the first tensor is looked at, to keep this off the step time: module.to()
        # moves all of them, and the constructor checked that they agree.
        home = self.device_ids[0]
        for tensor in chain(self.module.parameters(), self.module.buffers()):
            if tensor.device != home:
                raise DeviceError(
                    f"DataParallel needs every parameter and buffer on device_ids[0] ({home}), "
                    f"but found one on {tensor.device}.",
                    hint=f'Move the module back with .to("{home}") before calling it; '
                    "gk.placement(model.module) shows where each tensor is.",
                )
            return

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter ``inputs`` and ``kwargs``, run the replicas, and gather their outputs.

        Args:
            *inputs: the module's positional inputs; each tensor in them is split along
                ``dim``, every other value is passed to every replica unchanged.
            **kwargs: the module's keyword inputs, split the same way.
        """
        self._check_placement()
        first = self.device_ids[0]
        if len(self.device_ids) == 1:
            args, kw = mover(first)((inputs, kwargs))
            return gather_on([self.module(*args, **kw)], self.output_device, self.dim)
        chunks = scatter((inputs, kwargs), self.device_ids, self.dim, min_chunk=self.min_chunk)
        if len(chunks) == 1:
            args, kw = chunks[0]
            return gather_on([self.module(*args, **kw)], self.output_device, self.dim)
        replicas = replica_set(self.module, self.device_ids[1:])
        try:
            modules = [self.module, *replicas.refresh(self.module, len(chunks) - 1)]
            outputs = parallel_apply(
                modules,
                [args for args, _ in chunks],
                [kw for _, kw in chunks],
                self.device_ids[: len(chunks)],
            )
        finally:
            # Whatever happened, the replicas keep no tensors (and so no graph) past this call.
            replicas.release(len(chunks) - 1)
        return gather_on(outputs, self.output_device, self.dim)

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.device_ids)
        return f"device_ids=[{devices}], output_device={self.output_device}, dim={self.dim}"
