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
        dist.print_main(f"epoch {epoch}: loss {dist.all_reduce_mean(loss):.3f}")

Process groups, rendezvous and launching are torch.distributed's and torchrun's, under the
cluster's own scheduler; this module only reads the job's environment (torchrun, Slurm, Open
MPI, SkyPilot: :func:`environment`), picks the backend and device, and wires the model and data.
"""

from gpukit.distributed.data import DistributedLoader
from gpukit.distributed.environment import Environment, environment, torchrun_args
from gpukit.distributed.launcher import free_port, launch
from gpukit.distributed.process_group import (
    DistributedContext,
    all_reduce_mean,
    barrier,
    gather_for_metrics,
    get_logger,
    init,
    is_main,
    local_rank,
    prepare,
    print_main,
    rank,
    world_size,
)

__all__ = [
    "DistributedContext",
    "DistributedLoader",
    "Environment",
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
    "torchrun_args",
    "world_size",
]
