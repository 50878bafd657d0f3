"""``python preempt.py OUT``: the training of ``workloads.train``, preemptible at every step.

Each step ends with ``Preemption.should_stop()``. The first run stops at a fixed step in the
middle of an epoch and, rank 0 having written ``OUT/waiting``, waits there for the test's
``scancel --signal=USR1``; the check after it saves the training state (``gk.TrainingState``
in ``OUT/state``: model, optimizer, the loader's place in the epoch, random streams), requeues
the job through ``scontrol`` and exits 75. The run Slurm starts again resumes from the save,
mid-epoch, and writes ``OUT/rank<R>-<pid>.json`` as ``train.py`` does, with where it resumed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import workloads
from torch import nn
from torch.utils.data import DataLoader

from gpukit import distributed as dist
from gpukit.train import Preempted, Preemption, TrainingState

# A global batch that every world size of the tier (1 to 4 processes) splits evenly.
workloads.GLOBAL_BATCH = 12
WAIT_AT = 5  # epoch 0, after its 5th step of 9: mid-epoch


if __name__ == "__main__":
    out = Path(sys.argv[1])
    found = dist.environment()
    ctx = dist.init()
    model = workloads._model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = DataLoader(
        workloads._data(workloads.SAMPLES), batch_size=workloads.GLOBAL_BATCH, shuffle=True
    )
    model, opt, loader = dist.prepare(
        model, opt, data, global_batch_size=workloads.GLOBAL_BATCH, seed=7
    )
    state = TrainingState(out / "state", model=model, optimizer=opt, loader=loader)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    with state, Preemption() as preemption:
        resumed = state.resume()
        start = (loader.epoch, state.step)
        try:
            for _ in range(loader.epoch, workloads.EPOCHS):
                for x, y in loader:
                    loss = nn.functional.mse_loss(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()  # counted: state.step
                    if resumed is None and state.step == WAIT_AT:
                        if dist.is_main():
                            (out / "waiting").write_text(os.environ.get("SLURM_JOB_ID", ""))
                        deadline = time.monotonic() + 300
                        while preemption.received is None and time.monotonic() < deadline:
                            time.sleep(0.05)
                    if preemption.should_stop():
                        preemption.stop(state)
        except Preempted as stopped:
            Path(out, f"stopped-rank{ctx.rank}.json").write_text(
                json.dumps({"at": [loader.epoch, state.step], "checks": stopped.checks})
            )
            raise
    weights = torch.cat([p.detach().flatten() for p in inner.parameters()]).tolist()
    result = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "local_rank": ctx.local_rank,
        "backend": ctx.backend,
        "source": found.source,
        "host": os.uname().nodename,
        "resumed_at": list(start),
        "weights": weights,
    }
    Path(out, f"rank{ctx.rank}-{os.getpid()}.json").write_text(json.dumps(result))
