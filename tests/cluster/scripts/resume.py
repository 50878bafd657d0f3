"""``python resume.py OUT``: the training of ``workloads.train``, checkpointed after epoch 0.

The first run (``SLURM_RESTART_COUNT`` unset) saves the weights after the first epoch, says so
in ``OUT/checkpointed`` and waits to be requeued; the run after ``scontrol requeue`` loads
them, trains the last epoch and writes ``OUT/rank<R>-<pid>.json`` as ``train.py`` does.
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

# A global batch that every world size of the tier (1 to 4 processes) splits evenly.
workloads.GLOBAL_BATCH = 12

if __name__ == "__main__":
    out = Path(sys.argv[1])
    restarted = int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
    saved = out / "epoch0.pt"
    found = dist.environment()
    ctx = dist.init()
    model = workloads._model()
    if restarted:
        model.load_state_dict(torch.load(saved))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = DataLoader(
        workloads._data(workloads.SAMPLES), batch_size=workloads.GLOBAL_BATCH, shuffle=True
    )
    model, opt, loader = dist.prepare(
        model, opt, data, global_batch_size=workloads.GLOBAL_BATCH, seed=7
    )
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    for epoch in range(1 if restarted else 0, workloads.EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if not restarted:
            if dist.is_main():
                torch.save(inner.state_dict(), saved)
            dist.barrier()
            if dist.is_main():
                (out / "checkpointed").write_text(os.environ.get("SLURM_JOB_ID", ""))
            time.sleep(600)  # until scontrol requeue stops the step
    weights = torch.cat([p.detach().flatten() for p in inner.parameters()]).tolist()
    result = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "local_rank": ctx.local_rank,
        "backend": ctx.backend,
        "source": found.source,
        "host": os.uname().nodename,
        "weights": weights,
    }
    Path(out, f"rank{ctx.rank}-{os.getpid()}.json").write_text(json.dumps(result))
