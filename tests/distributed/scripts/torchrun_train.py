"""A training script as users write it, started by torchrun; writes its rank's result as JSON."""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

import workloads
from torch import nn

from gpukit import distributed as dist


def _threads_at_exit(out: Path) -> None:
    """Write the names of this process's threads; registered before init(), it runs after."""
    tasks = Path("/proc/self/task")
    names = [(tasks / task / "comm").read_text().strip() for task in os.listdir(tasks)]
    Path(out, f"{os.getpid()}.threads").write_text(json.dumps(names))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    Path(out, f"{os.getpid()}.pid").write_text(str(os.getpid()))
    atexit.register(_threads_at_exit, out)
    ctx = dist.init()
    weights = workloads.train()
    kept = dist.prepare(nn.Linear(2, 2))  # a model the script holds until it exits
    dist.barrier()
    result = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "weights": weights,
    }
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(result))
