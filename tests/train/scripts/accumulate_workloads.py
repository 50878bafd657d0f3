"""The exactness table of gradient accumulation: gpukit's loop and a one-process reference.

Every case trains in float64 under shuffle, for EPOCHS epochs, with a global batch of
GLOBAL_BATCH samples per optimizer step. The reference is plain torch: one process, the whole
global batch at once, the mean loss over its samples (or over its non-padding tokens). gpukit's
loop runs the same steps as K micro-batches per process, on 1, 2 or 3 processes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist

GLOBAL_BATCH = 36  # a multiple of processes x micro-batches for 1-3 processes and K = 1-3
EPOCHS = 2
SEED = 7
SIZES = (97, 101)  # last window: 25 samples (K=3: micro-batches 12, 12, 1) and 29
STEPS = (1, 2, 3)
OPTIMIZERS = ("sgd-momentum", "adamw")
VOCAB, LENGTH, IGNORE = 11, 6, -100


def _regression(samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 4, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)
    return TensorDataset(x, y + 0.1 * torch.randn(samples, 1, generator=gen, dtype=torch.float64))


def _sequences(samples: int) -> TensorDataset:
    """Sequences of 2-6 tokens padded to LENGTH; labels: the next tokens, padding ignored."""
    gen = torch.Generator().manual_seed(4321)
    tokens = torch.randint(VOCAB, (samples, LENGTH + 1), generator=gen)
    lengths = torch.randint(2, LENGTH + 2, (samples,), generator=gen)
    positions = torch.arange(LENGTH)
    labels = tokens[:, 1:].clone()
    labels[positions[None, :] >= (lengths[:, None] - 1)] = IGNORE
    return TensorDataset(tokens[:, :-1], labels)


class _TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(tokens)))


def _model(tokens: bool) -> nn.Module:
    torch.manual_seed(0)
    if tokens:
        return _TokenModel().double()
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd-momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _loss(model: nn.Module, batch: Any, tokens: bool) -> torch.Tensor:
    x, y = batch
    if tokens:
        logits = model(x)
        return nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=IGNORE
        )
    return nn.functional.mse_loss(model(x), y)


def _weights(model: nn.Module) -> list[float]:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return torch.cat([p.detach().flatten() for p in inner.parameters()]).tolist()


def cases(tokens_too: bool = True) -> list[tuple[int, int, str, bool]]:
    """(samples, K, optimizer, tokens) for every row of the table."""
    rows = [(n, k, o, False) for n in SIZES for k in STEPS for o in OPTIMIZERS]
    if tokens_too:
        rows += [(97, k, "adamw", True) for k in STEPS]
    return rows


def reference(samples: int, optimizer: str, tokens: bool) -> list[float]:
    """One process, the whole global batch per step: plain torch, no gpukit."""
    data = _sequences(samples) if tokens else _regression(samples)
    model = _model(tokens)
    opt = _optimizer(optimizer, model)
    for epoch in range(EPOCHS):
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(SEED + epoch))
        for start in range(0, samples, GLOBAL_BATCH):
            loss = _loss(model, data[order[start : start + GLOBAL_BATCH]], tokens)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return _weights(model)


def accumulated(samples: int, steps: int, optimizer: str, tokens: bool) -> list[float]:
    """gpukit's loop: K micro-batches per step on this process's share, one call per batch."""
    data = _sequences(samples) if tokens else _regression(samples)
    model = _model(tokens)
    opt = _optimizer(optimizer, model)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True)
    model, opt, loader = dist.prepare(
        model, opt, loader, global_batch_size=GLOBAL_BATCH, accumulate=steps, seed=SEED
    )
    for _ in range(EPOCHS):
        for batch in loader:
            loss = _loss(model, batch, tokens)
            count = (batch[1] != IGNORE).sum() if tokens else None
            dist.step(loss, count=count)
    return _weights(model)


def table(_: Any = None) -> dict[str, list[float]]:
    """Every case of the table on this process (launched: on each rank of the group)."""
    return {repr(case): accumulated(*case) for case in cases()}


def on_rank(rank: int, *case: Any) -> list[float]:
    """``accumulated(*case)`` on ``rank`` of a group that is already set up (two_processes)."""
    del rank  # the group knows it
    return accumulated(*case)


def clip(tokens: bool) -> float:
    """A norm some steps' gradients exceed (they are clipped) and others do not."""
    return 0.21 if tokens else 6.0


def _gradients(model: nn.Module) -> list[float]:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return torch.cat([p.grad.flatten() for p in inner.parameters() if p.grad is not None]).tolist()


def reference_norms(samples: int, optimizer: str, tokens: bool) -> dict[str, list[Any]]:
    """One process on the whole global batch, clipped by torch to ``clip(tokens)``: each step's
    total gradient norm (what ``clip_grad_norm_`` returns) and the clipped gradients the
    optimizer then used."""
    data = _sequences(samples) if tokens else _regression(samples)
    model = _model(tokens)
    opt = _optimizer(optimizer, model)
    norms, gradients = [], []
    for epoch in range(EPOCHS):
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(SEED + epoch))
        for start in range(0, samples, GLOBAL_BATCH):
            loss = _loss(model, data[order[start : start + GLOBAL_BATCH]], tokens)
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip(tokens))
            norms.append(norm.item())
            gradients.append(_gradients(model))
            opt.step()
    return {"norms": norms, "gradients": gradients}


def clipped_norms(samples: int, steps: int, optimizer: str, tokens: bool) -> dict[str, list[Any]]:
    """gpukit's loop clipping to ``clip(tokens)``: each step's reported norm, and the gradients a
    ``before_optimizer_step`` callback saw."""
    data = _sequences(samples) if tokens else _regression(samples)
    model = _model(tokens)
    opt = _optimizer(optimizer, model)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True)
    model, opt, loader = dist.prepare(
        model, opt, loader, global_batch_size=GLOBAL_BATCH, accumulate=steps, seed=SEED
    )
    norms: list[float] = []
    gradients: list[list[float]] = []
    for _ in range(EPOCHS):
        for batch in loader:
            count = (batch[1] != IGNORE).sum() if tokens else None
            result = dist.step(
                _loss(model, batch, tokens),
                count=count,
                clip_grad_norm=clip(tokens),
                before_optimizer_step=lambda: gradients.append(_gradients(model)),
            )
            if result:
                assert result.grad_norm is not None
                norms.append(result.grad_norm.item())
    return {"norms": norms, "gradients": gradients}


def clipped_on_rank(rank: int, *case: Any) -> dict[str, list[Any]]:
    """``clipped_norms(*case)`` on ``rank`` of a group that is already set up."""
    del rank
    return clipped_norms(*case)
