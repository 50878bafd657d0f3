"""Train in one process, then run the four-process job with gk.distributed.launch; print both."""

from __future__ import annotations

import json
import sys

from gpukit import distributed as dist
from tests.train import shard_workloads

if __name__ == "__main__":
    single = shard_workloads.train()  # here, before any group: the one-process reference
    ranks = dist.launch(shard_workloads.four_processes, 4, None, sys.argv[1])
    print(json.dumps({"single": single, "ranks": ranks}))
