"""Exact mode's workload: one training run, in a process of N, as module-level functions.

``run(case)`` trains a small model (dropout, LayerNorm) for two epochs over a dataset that
leaves a short last step, and returns its final weights and optimizer state, so that a test
compares them with ``torch.equal`` across numbers of processes. ``segment`` is one start of an
interrupted run: resume from the newest save in a folder, train, save every few steps, stop.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist
from gpukit.errors import InvalidArgumentError
from gpukit.train import Preempted, Preemption, TrainingState


@dataclass(frozen=True)
class Case:
    """One configuration: the same on every number of processes."""

    samples: int = 70  # 4 steps of 16 and one of 6: a short last step, its last micro-batch 2
    global_batch: int = 16
    micro: int = 4
    dtype: str = "float32"
    precision: str = "fp32"
    optimizer: str = "adamw"
    norm: str = "layer"
    dropout: float = 0.1
    epochs: int = 2
    shuffle: bool = True
    counts: bool = False  # weigh by per-sample counts (tokens) given to dist.step
    shard: bool = False  # FSDP2 (each Linear a unit) instead of the unwrapped model

    def but(self, **changes: Any) -> Case:
        """This case with some fields changed."""
        return replace(self, **changes)


def _data(case: Case) -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    dtype = getattr(torch, case.dtype)
    x = torch.randn(case.samples, 6, generator=gen, dtype=dtype)
    y = torch.randint(0, 3, (case.samples,), generator=gen)
    tokens = torch.randint(1, 5, (case.samples,), generator=gen)
    return TensorDataset(x, y, tokens)


def _model(case: Case) -> nn.Module:
    torch.manual_seed(3)
    norm: nn.Module = nn.LayerNorm(32) if case.norm == "layer" else nn.Identity()
    model = nn.Sequential(
        nn.Linear(6, 32),
        nn.GELU(),
        nn.Dropout(case.dropout),
        nn.Linear(32, 32),
        norm,
        nn.Linear(32, 3),
    )
    return model.to(getattr(torch, case.dtype))


def _optimizer(case: Case, model: nn.Module) -> torch.optim.Optimizer:
    if case.optimizer == "sgd-momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)


def _prepared(case: Case) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = _model(case)
    opt = _optimizer(case, model)
    loader = DataLoader(_data(case), batch_size=1, shuffle=case.shuffle)
    return dist.prepare(
        model,
        opt,
        loader,
        exact=True,
        global_batch_size=case.global_batch,
        micro_batch_size=case.micro,
        precision=case.precision,
        seed=11,
        shard=case.shard,
    )


def _train_step(model: nn.Module, loader: Any, case: Case, x: Any, y: Any, t: Any) -> bool:
    out = model(x)
    if not case.counts:
        return bool(dist.step(nn.functional.cross_entropy(out.float(), y)))
    per_sample = nn.functional.cross_entropy(out.float(), y, reduction="none") * t
    count = int(t.sum())
    loss = per_sample.sum() / max(count, 1)
    return bool(dist.step(loss, count=count))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor's copy; a sharded one's (a DTensor) gathered from every rank."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if callable(full) else tensor).detach().clone()


def _result(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    state = [
        _whole(value)
        for per_param in opt.state.values()
        for _, value in sorted(per_param.items())
        if isinstance(value, torch.Tensor)
    ]
    return {"weights": [_whole(p) for p in model.parameters()], "optimizer": state}


def run(case: Case) -> dict[str, list[torch.Tensor]]:
    """Train ``case`` from the start to the end; its final weights and optimizer state."""
    model, opt, loader = _prepared(case)
    model.train()
    for _ in range(case.epochs):
        for x, y, t in loader:
            _train_step(model, loader, case, x, y, t)
    return _result(model, opt)


def masks(case: Case) -> list[torch.Tensor]:
    """The dropout mask each micro-batch this process computed drew, in order."""
    model, _, loader = _prepared(case)
    model.train()
    seen: list[torch.Tensor] = []
    dropout = next(m for m in model.modules() if isinstance(m, nn.Dropout))
    dropout.register_forward_hook(lambda _m, args, out: seen.append((out == 0).clone()))
    for x, y, t in loader:
        _train_step(model, loader, case, x, y, t)
    return seen


def segment(
    case: Case,
    folder: str,
    stop_at: int | None,
    save_every: int = 3,
    progress: Any = None,
) -> dict[str, list[torch.Tensor]] | None:
    """One start of an interrupted run: resume, train, save every ``save_every`` steps
    (``progress(step)`` called after each), stop at ``stop_at`` (without saving: the steps
    since the last save are lost); the result at the end."""
    model, opt, loader = _prepared(case)
    state = TrainingState(folder, model=model, optimizer=opt, loader=loader, keep=2)
    state.resume()
    model.train()
    while loader.epoch < case.epochs:
        for x, y, t in loader:
            if _train_step(model, loader, case, x, y, t):  # state.step counts the step
                if state.step == stop_at:
                    state.wait()
                    return None
                if state.step % save_every == 0:
                    state.save()
                    if progress is not None:
                        progress(state.step)
    state.wait()
    return _result(model, opt)


def run_all(cases: list[Case]) -> list[dict[str, list[torch.Tensor]]]:
    """:func:`run` of each case in turn (one launch for many cases)."""
    return [run(case) for case in cases]


def normal_masks(case: Case) -> list[torch.Tensor]:
    """Outside exact mode: the dropout masks this process drew, one per micro-batch."""
    model = _model(case)
    opt = _optimizer(case, model)
    loader = DataLoader(_data(case), batch_size=1, shuffle=case.shuffle)
    model, opt, loader = dist.prepare(
        model, opt, loader, global_batch_size=case.global_batch, seed=11
    )
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    seen: list[torch.Tensor] = []
    dropout = next(m for m in inner.modules() if isinstance(m, nn.Dropout))
    dropout.register_forward_hook(lambda _m, args, out: seen.append((out == 0).clone()))
    model.train()
    for x, y, _t in loader:
        dist.step(nn.functional.cross_entropy(model(x).float(), y))
    return seen


def clipping_a_sharded_model(case: Case) -> str:
    """What ``dist.step(loss, clip_grad_norm=...)`` says to a sharded model in exact mode."""
    model, _, loader = _prepared(case.but(shard=True))
    before = [_whole(p) for p in model.parameters()]
    batches = iter(loader)  # kept: the pass lasts while its generator lives
    x, y, _t = next(batches)
    try:
        dist.step(nn.functional.cross_entropy(model(x).float(), y), clip_grad_norm=1.0)
    except InvalidArgumentError as refused:
        unchanged = all(
            torch.equal(a, _whole(b)) for a, b in zip(before, model.parameters(), strict=True)
        )
        return f"{refused} unchanged={unchanged}"
    return "stepped"


def everything(cases: list[Case], masked: Case) -> dict[str, Any]:
    """One launch's work: every case run, and the masks of ``masked`` in both modes."""
    return {
        "runs": run_all(cases),
        "masks": masks(masked),
        "normal_masks": normal_masks(masked),
        "clipping": clipping_a_sharded_model(masked) if dist.world_size() > 1 else None,
    }


def preempted(case: Case, folder: str, signal_after: int) -> dict[str, Any]:
    """A start stopped by SIGUSR1 (rank 0 signals itself after step ``signal_after``): every
    rank stops at the same step boundary, saves and raises ``Preempted``."""
    model, opt, loader = _prepared(case)
    state = TrainingState(folder, model=model, optimizer=opt, loader=loader, keep=2)
    model.train()
    try:
        with state, Preemption(env={}) as preemption:
            state.resume()
            while loader.epoch < case.epochs:
                for x, y, t in loader:
                    stepped = _train_step(model, loader, case, x, y, t)
                    if stepped and state.step == signal_after and dist.rank() == 0:
                        os.kill(os.getpid(), signal.SIGUSR1)
                    if preemption.should_stop():
                        preemption.stop(state)
    except Preempted as stopped:
        return {"code": stopped.code, "step": state.step}
    return {"code": None, "step": state.step}
