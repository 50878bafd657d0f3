"""Train in one process, then run the four-process job with gk.distributed.launch; print both.

Arguments: a DCP folder two processes saved, and a training-state folder two sharded processes
saved mid-run. Here, alone, this process also resumes that training state unsharded, and saves
one of its own for the four processes to resume sharded.
"""

from __future__ import annotations

import json
import sys
import tempfile

from gpukit import distributed as dist
from tests.train import shard_workloads

if __name__ == "__main__":
    # Here, before any group: the one-process reference, and the one-process resumes and saves.
    single = shard_workloads.train()
    one = shard_workloads.run_with_state(0, sys.argv[2])["weights"]
    with tempfile.TemporaryDirectory() as unsharded:
        shard_workloads.run_with_state(0, unsharded, shard_workloads.STOP)
        ranks = dist.launch(shard_workloads.four_processes, 4, None, *sys.argv[1:3], unsharded)
    print(json.dumps({"single": single, "one": one, "ranks": ranks}))
