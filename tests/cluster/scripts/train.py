"""``python train.py OUT``: the distributed tests' training, as a job's users start it.

Each process writes ``OUT/rank<R>-<pid>.json``: where gpukit placed it and its final weights,
so that a test sees two separate trainings (two files for rank 0) as well as a shared one.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import workloads

from gpukit import distributed as dist

# A global batch that every world size of the tier (1 to 4 processes) splits evenly.
workloads.GLOBAL_BATCH = 12

if __name__ == "__main__":
    out = Path(sys.argv[1])
    found = dist.environment()
    ctx = dist.init()
    weights = workloads.train()
    result = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "local_rank": ctx.local_rank,
        "backend": ctx.backend,
        "source": found.source,
        "host": socket.gethostname(),
        "weights": weights,
    }
    Path(out, f"rank{ctx.rank}-{os.getpid()}.json").write_text(json.dumps(result))
