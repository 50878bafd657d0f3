"""The documented preemptible loop with ``accumulate=2``, for one process or a group of two.

``segment(rank, folder, signal_at=M)`` is one start of the training script: it resumes from
the newest complete save in ``folder``, trains (two micro-batches per optimizer step, each
ended by ``dist.step(loss)``, ``preemption.should_stop()`` after each), and, when this rank is
``signalled`` and its M-th micro-batch of this start is done, sends itself ``signals`` (SIGUSR1
by default, one per micro-batch from there). It returns what a test needs to see: where the
stop came, what became of the requeue, or the final weights. A fake ``scontrol`` in ``bin_dir``
notes the requeues. Module level, so that the other rank of ``two_processes`` imports it.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tests.train.workload import Samples
from torch import nn
from torch.utils.data import DataLoader

from gpukit import distributed as dist
from gpukit.train import Preempted, Preemption, TrainingState

GLOBAL_BATCH = 8  # two micro-batches a step, of 2 samples per process on two processes
ACCUMULATE = 2
EPOCHS = 2
JOB_ID = "77"


def fake_scontrol(bin_dir: Path) -> Path:
    """An ``scontrol`` that appends its arguments to ``bin_dir/calls`` and succeeds."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    program = bin_dir / "scontrol"
    program.write_text(f'#!/bin/sh\necho "$@" >> {bin_dir}/calls\n')
    program.chmod(0o755)
    return bin_dir


class Window:
    """A training step that says it is between micro-batches while ``mid`` is true."""

    def __init__(self) -> None:
        self.mid = False

    @property
    def mid_step(self) -> bool:
        return self.mid


def _weights(model: nn.Module) -> list[float]:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return torch.cat([p.detach().flatten() for p in inner.parameters()]).tolist()


def segment(
    rank: int,
    folder: str,
    bin_dir: str = "",
    signal_at: int | None = None,
    signalled: int = 1,
    signals: tuple[int, ...] = (signal.SIGUSR1,),
) -> dict[str, Any]:
    """One start of the run on ``rank``: resume, train until preempted or to the end."""
    assert rank == dist.rank()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _segment(rank, folder, bin_dir, signal_at, signalled, signals)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _segment(
    rank: int,
    folder: str,
    bin_dir: str,
    signal_at: int | None,
    signalled: int,
    signals: tuple[int, ...],
) -> dict[str, Any]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1)).double()
    seed = 100 + rank  # each rank its own streams (dropout)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = DataLoader(Samples(), batch_size=GLOBAL_BATCH, shuffle=True)
    model, opt, loader = dist.prepare(
        model, opt, loader, global_batch_size=GLOBAL_BATCH, accumulate=ACCUMULATE, seed=7
    )
    state = TrainingState(folder, model=model, optimizer=opt, loader=loader)
    env = {"SLURM_JOB_ID": JOB_ID, "PATH": bin_dir}
    micro = 0
    stepped = False
    stepped_at_signal: list[bool] = []
    try:
        with state, Preemption(env=env) as preemption:
            resumed = state.resume()
            for _ in range(loader.epoch, EPOCHS):
                for x, y in loader:
                    micro += 1
                    # state.step counts the optimizer's steps by itself
                    stepped = bool(dist.step(nn.functional.mse_loss(model(x), y)))
                    sent = micro - signal_at if signal_at is not None else -1
                    if rank == signalled and 0 <= sent < len(signals):
                        stepped_at_signal.append(stepped)
                        os.kill(os.getpid(), signals[sent])
                    if preemption.should_stop():
                        preemption.stop(state)
    except Preempted as stopped:
        requeue = stopped.requeue
        return {
            "code": stopped.code,
            "micro": micro,
            "stepped": stepped,
            "step": state.step,
            "checks": stopped.checks,
            "requeue": None if requeue is None else (requeue.done, requeue.reason),
            "stepped_at_signal": stepped_at_signal,
        }
    return {
        "resumed": None if resumed is None else resumed.step,
        "weights": _weights(model),
        "stepped_at_signal": stepped_at_signal,
    }
