"""Memory per process of sharded training (FSDP2) against DDP, for 1, 2 and 4 processes.

Both runs train the same stack of repeated blocks with AdamW through ``gk.distributed.launch``
and ``prepare(..., shard=True)`` or plain ``prepare`` (DDP). Each process reports two figures:

- tensor bytes it holds after a step: its parameters, gradients and optimizer state (for a
  sharded model, the local shards of each DTensor);
- its peak resident memory (Linux ``VmHWM``) over the training steps, above what it held before
  the model was built (so torch's own libraries are left out). The peak is reset after
  ``prepare``, and memory freed by sharding returned to the system first (``malloc_trim``), so
  the full model each process builds before sharding it is not counted: building it on the
  ``meta`` device avoids that cost in a real job. glibc is asked to return large freed blocks
  at once (see :func:`_allocator_returns_large_blocks`), in both runs.

The largest figure over the processes is reported (they differ by FSDP's padding only).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpukit import distributed as dist
from gpukit.bench.core import BenchResult, machine_description
from gpukit.memory.stats import proc_memory, reset_peak_rss

SUITE = "shard"
_MIB = 1 << 20


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors)


_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
_MMAP_THRESHOLD = 256 << 10


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


def _allocator_returns_large_blocks() -> None:
    """Have glibc give blocks of 256 KiB or more back to the system as soon as they are freed.

    By default glibc raises that threshold after the first large free, and later blocks of the
    same size then come from the heap, where freed space stays resident: FSDP's per-block
    buffers (an all-gathered block, its full gradient) then grow RSS step after step, and the
    figure measures the allocator instead of the tensors. ``MALLOC_MMAP_THRESHOLD_=262144`` in
    the environment does the same for a training job.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def _trim() -> None:
    """Give memory that Python and torch freed back to the system (glibc), so RSS shows use."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _train(shard: bool, width: int, blocks: int, steps: int, batch: int) -> dict[str, int]:
    """One process's tensor bytes and peak RSS growth (both in bytes) over a few AdamW steps."""
    torch.set_num_threads(1)
    _allocator_returns_large_blocks()
    importlib.import_module("torch.distributed.fsdp")  # prepare's imports: not the model's memory
    _trim()
    before = proc_memory().rss or 0
    torch.manual_seed(0)
    model = nn.Sequential(*(_Block(width) for _ in range(blocks)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    net, opt = dist.prepare(model, opt, shard=shard)
    del model
    _trim()
    prepared = proc_memory().rss or 0
    reset_peak_rss()
    for _ in range(steps):
        loss = net(torch.randn(batch, width)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    params = list(net.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    peak = proc_memory().peak_rss or 0
    dist.barrier()
    return {
        "parameters": _bytes(params),
        "gradients": _bytes(grads),
        "optimizer": _bytes(state),
        "tensors": _bytes(params) + _bytes(grads) + _bytes(state),
        "peak_rss_growth": max(0, peak - before),
        "rss_growth_in_prepare": max(0, prepared - before),
    }


def _largest(ranks: list[dict[str, int]]) -> dict[str, int]:
    return {key: max(r[key] for r in ranks) for key in ranks[0]}


def run(quick: bool = False) -> list[BenchResult]:
    """Per-process memory, sharded against DDP, for each number of processes."""
    width, blocks, steps, batch = (256, 4, 2, 8) if quick else (1024, 8, 3, 16)
    counts = (1, 2) if quick else (1, 2, 4)
    model_bytes = blocks * (width * width + width) * 4
    model = (
        f"{blocks} blocks of Linear({width}, {width}) in float32 ({model_bytes / _MIB:.0f} MiB of "
        f"parameters), AdamW, {steps} steps of {batch} samples per process, gloo on CPU"
    )
    results: list[BenchResult] = []
    for n in counts:
        sharded = _largest(dist.launch(_train, n, True, width, blocks, steps, batch))
        ddp = _largest(dist.launch(_train, n, False, width, blocks, steps, batch))
        extra: dict[str, Any] = {
            "processes": n,
            "sharded": sharded,
            "ddp": ddp,
            "machine": machine_description(),
        }
        for key, label in (
            ("tensors", "parameters + gradients + optimizer state per process"),
            ("peak_rss_growth", "peak RSS growth per process while training"),
        ):
            results.append(
                BenchResult(
                    suite=SUITE,
                    name=f"sharded, {n} process{'es' if n > 1 else ''}: {label}",
                    value=sharded[key] / _MIB,
                    unit="MiB",
                    baseline_name=f"DDP, {n} process{'es' if n > 1 else ''}",
                    baseline_value=ddp[key] / _MIB,
                    target=f"≈ 1/{n} for the tensors" if key == "tensors" and n > 1 else None,
                    note=model,
                    extra=extra,
                )
            )
    return results
