"""A small resumable training run, cut into segments as an interrupted run is, in 1 or N processes.

``segment(folder, stop_at)`` is what one start of a training script does: build everything
fresh, resume from the newest complete save in ``folder`` (if any), train, save every
``SAVE_EVERY`` steps, and stop at step ``stop_at`` without saving (the process "dies" there:
the steps since the last save are lost and done again by the next segment). A segment that
reaches the end returns the final weights. Module level, so that launched workers import it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gpukit import distributed as dist
from gpukit.train import TrainingState

SAMPLES = 43  # 7 global batches of 6 and one of 1: on 2 or 3 ranks some get an empty share
GLOBAL_BATCH = 6  # divides over 1, 2 and 3 processes
EPOCHS = 3
STEPS = EPOCHS * 8
SAVE_EVERY = 5


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A float64 regression set; counts the samples fetched (in this process)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, 4, generator=gen, dtype=torch.float64)
        noise = 0.1 * torch.randn(SAMPLES, 1, generator=gen, dtype=torch.float64)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + noise
        self.fetched = 0

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.fetched += 1
        return self.x[index], self.y[index]


def _model(dropout: float) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 1)).double()


def _weights(model: nn.Module) -> list[float]:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return torch.cat([p.detach().flatten() for p in inner.parameters()]).tolist()


class Noise:
    """A user extra that draws from NumPy and Python each step, so both streams matter."""

    def __init__(self) -> None:
        self.total = 0.0

    def draw(self) -> float:
        self.total += float(np.random.rand()) + random.random()
        return self.total

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = state["total"]


def segment(
    folder: str,
    stop_at: int | None = None,
    *,
    dropout: float = 0.2,
    num_workers: int = 2,
    noise: bool = True,
    restore_rng: bool = True,
    save_every: int = SAVE_EVERY,
    progress: Callable[[int], None] | None = None,
    accumulate: int = 1,
) -> list[float] | None:
    """One start of the run: resume, train to ``stop_at`` (then die) or to the end.

    ``noise`` scales each rank's loss by a number drawn from its own NumPy and Python streams
    (a rank-specific extra); ``progress`` is called with the step after each save. With
    ``accumulate`` > 1 each optimizer step takes that many micro-batches through ``dist.step``,
    and a run stopped at ``stop_at`` dies in the middle of the next step's micro-batches, with
    gradients accumulated that no save holds.
    """
    torch.use_deterministic_algorithms(True)
    rank = dist.rank()
    seed = 100 + rank  # each rank its own streams, as a script that seeds per rank has
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = _model(dropout)
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    loader = DataLoader(
        Samples(),
        batch_size=GLOBAL_BATCH,
        shuffle=True,
        num_workers=num_workers,
        # Forked workers: launched ranks are spawned, and so would their workers be, each
        # importing torch again every epoch.
        multiprocessing_context="fork" if num_workers else None,
    )
    model, opt, loader = dist.prepare(
        model, opt, loader, global_batch_size=GLOBAL_BATCH, seed=7, accumulate=accumulate
    )
    drawn = Noise()
    state = TrainingState(
        folder,
        model=model,
        optimizer=opt,
        scheduler=sched,
        loader=loader,
        rank_extras={"noise": drawn},  # each rank draws its own: saved by each rank
    )
    dying = False
    with state:
        if restore_rng:
            state.resume()
        else:  # a realistic bug: everything but the random streams comes back
            saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
            state.resume()
            torch.set_rng_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])
        for _ in range(loader.epoch, EPOCHS):
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                if noise:
                    loss = loss * (1 + 1e-3 * drawn.draw())
                if accumulate > 1:
                    stepped = dist.step(loss)
                    if dying:
                        return None  # dies in the next step (between its micro-batches if any)
                    if not stepped:
                        continue
                else:
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                sched.step()  # state.step counted the optimizer's step
                if state.step == stop_at:
                    if accumulate == 1:
                        return None  # dies here: what was not saved is lost
                    dying = True
                if state.step % save_every == 0:
                    state.save()
                    if progress is not None:
                        progress(state.step)
    return _weights(model)


def segments(folder: str, stops: list[int], **options: Any) -> list[float] | None:
    """The run started once per stop and once more to the end, in one process (or group)."""
    for stop in stops:
        assert segment(folder, stop, **options) is None
    return segment(folder, **options)


EXACT: dict[str, Any] = {}  # dropout and per-rank noise: bitwise on the same world size
PLAIN: dict[str, Any] = {"dropout": 0.0, "noise": False}  # no per-sample randomness
ACCUMULATED: dict[str, Any] = {"accumulate": 3, "num_workers": 0}  # 3 micro-batches a step
"""What a run must be for its weights not to depend on the world size (see docs/training.md):
nothing drawn per sample from a rank's own random streams."""


def cases(root: str, stops: list[int], handoff: int) -> dict[str, Any]:
    """A launched group's share of the tests: the run whole, the run interrupted at ``stops``
    (both EXACT), the PLAIN run whole, and a PLAIN run stopped at ``handoff``, left for another
    number of processes to finish."""
    base = Path(root) / f"world{dist.world_size()}"
    found = {
        "whole": segment(str(base / "whole"), **EXACT),
        "cut": segments(str(base / "cut"), stops, **EXACT),
        "plain": segment(str(base / "plain"), **PLAIN),
    }
    assert segment(str(base / "handoff"), handoff, **PLAIN) is None
    # 3 micro-batches of GLOBAL_BATCH / 3 samples: one and two processes share them evenly.
    found["accumulated"] = segment(str(base / "acc-whole"), **ACCUMULATED)
    found["accumulated_cut"] = segments(str(base / "acc-cut"), stops, **ACCUMULATED)
    found["accumulated_plain"] = segment(str(base / "acc-plain"), **PLAIN, **ACCUMULATED)
    assert segment(str(base / "acc-handoff"), handoff, **PLAIN, **ACCUMULATED) is None
    return found


def finish(folder: str, **options: Any) -> list[float] | None:
    """The PLAIN run resumed from ``folder`` (saved by another number of processes), to the end."""
    return segment(folder, **PLAIN, **options)
