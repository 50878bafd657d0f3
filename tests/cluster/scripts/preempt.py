"""``python preempt.py OUT``: the training of ``workloads.train``, preemptible at every step.

Each step ends with ``Preemption.should_stop()``. The first run stops at a fixed step in the
middle of an epoch and, rank 0 having written ``OUT/waiting``, waits there for the test's
``scancel --signal=USR1``; the check after it saves (model, optimizer, epoch, step: one
``torch.save`` by rank 0, to a temporary file renamed over ``OUT/state.pt``), requeues the job
through ``scontrol`` and exits 75. The run Slurm starts again resumes from the save, skipping
the epoch's batches already trained, and writes ``OUT/rank<R>-<pid>.json`` as ``train.py``
does, with where it resumed.
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
from gpukit.train.preempt import Preempted, Preemption

# A global batch that every world size of the tier (1 to 4 processes) splits evenly.
workloads.GLOBAL_BATCH = 12
WAIT_AT = (0, 4)  # epoch 0, after its 5th step of 9: mid-epoch


def _save(path: Path, model: nn.Module, opt: torch.optim.Optimizer, epoch: int, step: int) -> None:
    if dist.is_main():
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "at": [epoch, step]}
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        torch.save(state, temporary)
        os.replace(temporary, path)  # complete or absent, never half written


if __name__ == "__main__":
    out = Path(sys.argv[1])
    saved = out / "state.pt"
    found = dist.environment()
    ctx = dist.init()
    model = workloads._model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = (0, 0)
    if saved.exists():
        state = torch.load(saved)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = tuple(state["at"])
    data = DataLoader(
        workloads._data(workloads.SAMPLES), batch_size=workloads.GLOBAL_BATCH, shuffle=True
    )
    model, opt, loader = dist.prepare(
        model, opt, data, global_batch_size=workloads.GLOBAL_BATCH, seed=7
    )
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    with Preemption() as preemption:
        try:
            for epoch in range(start[0], workloads.EPOCHS):
                loader.set_epoch(epoch)
                for step, (x, y) in enumerate(loader):
                    if (epoch, step) < start:
                        continue  # trained before the save
                    loss = nn.functional.mse_loss(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if start == (0, 0) and (epoch, step) == WAIT_AT:
                        if dist.is_main():
                            (out / "waiting").write_text(os.environ.get("SLURM_JOB_ID", ""))
                        deadline = time.monotonic() + 300
                        while preemption.received is None and time.monotonic() < deadline:
                            time.sleep(0.05)
                    if preemption.should_stop():
                        done = (epoch, step + 1)
                        preemption.stop(lambda at=done: _save(saved, inner, opt, *at))
        except Preempted as stopped:
            Path(out, f"stopped-rank{ctx.rank}.json").write_text(
                json.dumps({"at": [epoch, step], "checks": stopped.checks})
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
