"""One process per device, on one machine or many: ``gk.distributed``, on torch.distributed.

The same script runs with ``python train.py`` (one process, nothing to set up) and with
``torchrun --nproc-per-node=N train.py`` (N processes joined in a process group)::

    import gpukit as gk
    from gpukit import distributed as dist

    dist.init()
    model, opt, loader = dist.prepare(model, opt, loader, per_device_batch_size=32)
    for epoch in range(3):
        for x, y in loader:          # this process's shard, already on its device
            loss = loss_fn(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()   # DDP averages the gradients
        dist.print_main(f"epoch {epoch}: loss {dist.all_reduce_mean(loss, weight=len(x)):.3f}")

With ``prepare(..., accumulate=K, precision="auto")`` the loop ends each batch with
``dist.step(loss)`` instead (see :mod:`gpukit.train.step`).

Process groups, rendezvous and launching are torch.distributed's and torchrun's, under the
cluster's own scheduler; this module only reads the job's environment (torchrun, Slurm, Open
MPI, SkyPilot: :func:`environment`), picks the backend and device, and wires the model and data.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Reading the job never imports torch, so `gpukit run --ddp` stays fast; it is imported here
# at once, which also makes `environment` the function, not its module of the same name.
from gpukit.distributed.environment import Environment, environment
from gpukit.distributed.torchrun import torchrun_args

# Everything else needs torch: loaded on first use.
_EXPORTS = {
    "DistributedLoader": "gpukit.distributed.data",
    "WorkerStart": "gpukit.distributed.workers",
    "free_port": "gpukit.distributed.launcher",
    "launch": "gpukit.distributed.launcher",
    "all_reduce_mean": "gpukit.distributed.metrics",
    "gather_for_metrics": "gpukit.distributed.metrics",
    "prepare": "gpukit.distributed.ddp",
    "sample_generator": "gpukit.distributed.streams",
    "step": "gpukit.train.step",
    **{
        name: "gpukit.distributed.process_group"
        for name in (
            "DistributedContext",
            "barrier",
            "get_logger",
            "init",
            "is_main",
            "local_rank",
            "print_main",
            "rank",
            "world_size",
        )
    },
}

if TYPE_CHECKING:
    from gpukit.distributed.data import DistributedLoader as DistributedLoader
    from gpukit.distributed.ddp import prepare as prepare
    from gpukit.distributed.launcher import free_port as free_port
    from gpukit.distributed.launcher import launch as launch
    from gpukit.distributed.metrics import all_reduce_mean as all_reduce_mean
    from gpukit.distributed.metrics import gather_for_metrics as gather_for_metrics
    from gpukit.distributed.process_group import DistributedContext as DistributedContext
    from gpukit.distributed.process_group import barrier as barrier
    from gpukit.distributed.process_group import get_logger as get_logger
    from gpukit.distributed.process_group import init as init
    from gpukit.distributed.process_group import is_main as is_main
    from gpukit.distributed.process_group import local_rank as local_rank
    from gpukit.distributed.process_group import print_main as print_main
    from gpukit.distributed.process_group import rank as rank
    from gpukit.distributed.process_group import world_size as world_size
    from gpukit.distributed.streams import sample_generator as sample_generator
    from gpukit.distributed.workers import WorkerStart as WorkerStart
    from gpukit.train.step import step as step

__all__ = [
    "DistributedContext",
    "DistributedLoader",
    "Environment",
    "WorkerStart",
    "all_reduce_mean",
    "barrier",
    "environment",
    "free_port",
    "gather_for_metrics",
    "get_logger",
    "init",
    "is_main",
    "launch",
    "local_rank",
    "prepare",
    "print_main",
    "rank",
    "sample_generator",
    "step",
    "torchrun_args",
    "world_size",
]


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'gpukit.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(target), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
