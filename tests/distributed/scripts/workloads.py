"""Tiny training and evaluation jobs run by the distributed tests, in 1 or N processes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist
from gpukit.errors import DistributedError

SAMPLES = 101  # 12 global batches of 8 and one of 5, split 3 + 2 over 2 processes
SAMPLES_WITH_AN_EMPTY_SHARE = 97  # the last global batch has 1 sample: rank 1 gets none
GLOBAL_BATCH = 8
EPOCHS = 2
EVAL_SAMPLES = 11  # not divisible by 2 processes: the last batch is split unevenly
EVAL_BATCH = 3


def _data(samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 4, generator=gen, dtype=torch.float64)
    noise = 0.1 * torch.randn(samples, 1, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + noise
    return TensorDataset(x, y)


def _model() -> nn.Module:
    # float64, so that the only difference between 1 and N processes is the order of sums.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def train(samples: int = SAMPLES, momentum: float = 0.0) -> list[float]:
    """Train with SGD on GLOBAL_BATCH samples per step, whatever the world size; final weights."""
    return train_and_log(samples, momentum)[0]


def train_and_log(samples: int = SAMPLES, momentum: float = 0.0) -> tuple[list[float], list[float]]:
    """Final weights, and the global batch's mean loss of every step as the processes log it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    loader = DataLoader(_data(samples), batch_size=GLOBAL_BATCH, shuffle=True)
    model, opt, loader = dist.prepare(model, opt, loader, global_batch_size=GLOBAL_BATCH, seed=7)
    losses: list[float] = []
    for _ in range(EPOCHS):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            losses.append(dist.all_reduce_mean(loss.item(), weight=len(x)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return torch.cat([p.detach().flatten() for p in inner.parameters()]).tolist(), losses


def evaluate_ids() -> list[int]:
    """Gather the sample ids seen by every process over one pass of a shuffled loader."""
    ids = TensorDataset(torch.arange(EVAL_SAMPLES))
    loader = DataLoader(ids, batch_size=EVAL_BATCH, shuffle=True)
    _, loader = dist.prepare(nn.Linear(1, 1), loader=loader, per_device_batch_size=EVAL_BATCH)
    seen: list[int] = []
    for (batch,) in loader:
        seen += dist.gather_for_metrics(batch).tolist()
    return seen


def gather_dict_built_in_rank_order() -> dict[str, list[int]]:
    """Each rank builds {"a": [10r], "b": [10r + 1]}, rank 1 with its keys in the other order."""
    r = dist.rank()
    items = [("a", torch.tensor([10 * r])), ("b", torch.tensor([10 * r + 1]))]
    values = dict(items if r == 0 else items[::-1])
    gathered = dist.gather_for_metrics(values)
    return {key: gathered[key].tolist() for key in sorted(gathered)}


def gather_dicts_with_different_keys() -> str:
    """Rank 0 passes keys a and b, rank 1 a and c: every rank gets the error, none hangs."""
    keys = ["a", "b"] if dist.rank() == 0 else ["a", "c"]
    try:
        dist.gather_for_metrics({key: torch.zeros(1) for key in keys})
    except DistributedError as exc:
        dist.barrier()  # the group still works afterwards
        return str(exc)
    return "no error"


def session(_: Any = None) -> dict[str, Any]:
    """Everything one launched process reports back to the test."""
    ctx = dist.init()
    dist.barrier()
    return {
        "rank": dist.rank(),
        "world_size": dist.world_size(),
        "local_rank": dist.local_rank(),
        "backend": ctx.backend,
        "is_main": dist.is_main(),
        "mean_of_ranks": dist.all_reduce_mean(float(dist.rank())),
        "weights": train(),
        "weights_with_an_empty_share": train(SAMPLES_WITH_AN_EMPTY_SHARE, momentum=0.9),
        "logged_losses": train_and_log(SAMPLES_WITH_AN_EMPTY_SHARE)[1],
        "eval_ids": evaluate_ids(),
        "gathered_by_key": gather_dict_built_in_rank_order(),
        "mismatch": gather_dicts_with_different_keys(),
        "pid": os.getpid(),
    }


def failing(mode: str, pid_dir: str) -> None:
    """Rank 1 fails (raises, or is killed) while rank 0 waits for it in a collective."""
    Path(pid_dir, f"{os.getpid()}.pid").write_text(str(os.getpid()))
    dist.barrier()  # both have started: rank 1 no longer fails before rank 0 has begun
    if dist.rank() == 1:
        if mode == "kill":
            os.kill(os.getpid(), 9)
        raise ValueError("boom from the test worker")
    dist.barrier()  # never completes: rank 1 is gone
