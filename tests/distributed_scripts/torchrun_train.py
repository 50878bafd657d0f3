"""A training script as users write it, started by torchrun; writes its rank's result as JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import workloads

from gpukit import distributed as dist

if __name__ == "__main__":
    out = Path(sys.argv[1])
    Path(out, f"{os.getpid()}.pid").write_text(str(os.getpid()))
    ctx = dist.init()
    weights = workloads.train()
    dist.barrier()
    result = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "weights": weights,
    }
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(result))
