"""Started by torchrun with restarts: rank 1 dies on the first attempt, the restart trains.

Each process of the attempt that trains writes ``OUT/rank<R>.json`` with its final weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import workloads

from gpukit import distributed as dist

if __name__ == "__main__":
    out = Path(sys.argv[1])
    ctx = dist.init()
    dist.barrier()  # every rank joined the first attempt's group before rank 1 dies
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and ctx.rank == 1:
        sys.exit(3)
    weights = workloads.train()
    result = {"rank": ctx.rank, "world_size": ctx.world_size, "weights": weights}
    result["restart"] = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(result))
