"""The four-process jobs of the sharding tests, run with gk.distributed.launch; prints JSON.

``shard_four.py train``: one process trains unsharded (the reference), then four sharded
processes train the same run; prints both weights.

``shard_four.py checkpoint DCP_FOLDER STATE_FOLDER``: a DCP folder two processes saved, and a
training-state folder two sharded processes saved mid-run. Here, alone, this process trains the
reference, resumes that training state unsharded, and saves one of its own for the four
processes to resume sharded; then the four load the folder and resume both states.
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
    if sys.argv[1] == "train":
        print(json.dumps({"single": single, "ranks": dist.launch(shard_workloads.train, 4, None)}))
        sys.exit(0)
    one = shard_workloads.run_with_state(0, sys.argv[3])["weights"]
    with tempfile.TemporaryDirectory() as unsharded:
        shard_workloads.run_with_state(0, unsharded, shard_workloads.STOP)
        ranks = dist.launch(shard_workloads.four_processes, 4, None, *sys.argv[2:4], unsharded)
    print(json.dumps({"single": single, "one": one, "ranks": ranks}))
