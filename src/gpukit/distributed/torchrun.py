"""torchrun's options for ``gpukit run --ddp``: one torchrun per node, joined as the job says.

Where the job is (:func:`~gpukit.distributed.environment.environment`) decides what torchrun is
told: ``--standalone`` on one node, else the job's node count and a c10d rendezvous on its first
node, at a port derived from the job, so no address is exported by hand. Launches that would
start a torchrun per task, or torchrun inside torchrun, are refused here, before anything runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from gpukit.distributed.environment import (
    environment,
    launcher_names,
    slurm_allocation_nodes,
)
from gpukit.errors import DistributedError

__all__ = ["torchrun_args"]


def torchrun_args(nproc_per_node: int, env: Mapping[str, str] | None = None) -> list[str]:
    """torchrun's options for this node of the job: nodes, node rank, processes, rendezvous.

    Run once per node (``srun --ntasks-per-node=1``, or SkyPilot's ``run:``): every node gets
    the same c10d rendezvous on the job's first node, at a port and with an id derived from
    the job, so no address is exported by hand. Outside a multi-node job it is
    ``--standalone`` (a rendezvous of its own on this machine). Several tasks on one node are
    refused (each would start its own torchrun), on one node as on several.

    >>> torchrun_args(4, {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
    ...     "SKYPILOT_NODE_IPS": "10.0.0.5\\n10.0.0.6", "MASTER_PORT": "29400"})
    ['--nnodes=2', '--nproc-per-node=4', '--rdzv-backend=c10d', \
'--rdzv-endpoint=10.0.0.5:29400', '--rdzv-id=gpukit-29400']
    """
    if (
        isinstance(nproc_per_node, bool)
        or not isinstance(nproc_per_node, int)
        or nproc_per_node < 1
    ):
        raise DistributedError(
            f"torchrun_args() was asked for nproc_per_node={nproc_per_node!r}.",
            hint="Pass the number of processes to start on this node, e.g. its GPU count.",
        )
    found = environment(env)
    if found.source == "torchrun":
        raise DistributedError(
            f"This process already runs under torchrun (rank {found.rank} of "
            f"{found.world_size}): starting torchrun again would nest two process groups.",
            hint="Run `gpukit run --ddp` from the job script or srun, not from a training worker.",
        )
    env = os.environ if env is None else env
    nodes = slurm_allocation_nodes(env)
    if found.source is None and env.get("SLURM_JOB_ID") and nodes > 1:
        raise DistributedError(
            f"This runs in Slurm job {env['SLURM_JOB_ID']}'s script, outside any srun step, so "
            f"it would start torchrun on 1 of the job's {nodes} nodes.",
            hint="Start it on every node: `srun --ntasks-per-node=1 gpukit run --ddp -n N -- "
            "train.py` (or `srun -N1 ...` to use one node on purpose).",
        )
    if found.local_world_size != 1:
        # Checked before the one-node case: srun -N1 -n2 would otherwise start two standalone
        # torchruns, two separate trainings (and, on a GPU node, two claims).
        _, size_var = launcher_names(found.source)
        processes = f"{nproc_per_node} process{'es' if nproc_per_node != 1 else ''}"
        raise DistributedError(
            f"{found.source} started {found.local_world_size} tasks on this node ({size_var}), "
            f"but torchrun starts the node's {processes} itself: each task would start its own "
            "torchrun, and its own training.",
            hint="Start one task per node: `srun --ntasks-per-node=1 gpukit run --ddp -n N -- "
            "train.py`.",
        )
    if found.num_nodes <= 1:
        return ["--standalone", f"--nproc-per-node={nproc_per_node}"]
    # _check refused a multi-node job without a rendezvous address and port.
    assert found.master_addr is not None
    assert found.master_port is not None
    run_id = found.job_id or f"gpukit-{found.master_port}"
    # No --node-rank: the c10d rendezvous numbers the nodes itself (torchrun ignores it, and
    # says so).
    return [
        f"--nnodes={found.num_nodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={found.master_addr}:{found.master_port}",
        f"--rdzv-id={run_id}",
    ]
