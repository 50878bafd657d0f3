"""Step time of ``gk.DataParallel`` against the plain module, and against ``nn.DataParallel``.

One step is zero_grad, forward, cross-entropy, backward and an SGD step on an MLP. The figures:
the overhead of wrapping on one device (target: under 5% for a mid-sized MLP at batch 256),
how step time changes with 1, 2 and 4 replicas on the CPU, and, where CUDA devices exist,
gk.DataParallel against nn.DataParallel on the same GPUs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gpukit.bench.core import BenchResult, compare, machine_description
from gpukit.parallel.data_parallel import DataParallel

SUITE = "data_parallel"

__all__ = ["run"]


def _mlp(width: int, depth: int, inputs: int, classes: int) -> nn.Module:
    layers: list[nn.Module] = []
    size = inputs
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    layers.append(nn.Linear(size, classes))
    return nn.Sequential(*layers)


def _stepper(
    model: nn.Module, params: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], object]:
    optimizer = torch.optim.SGD(params.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        if x.is_cuda:
            torch.cuda.synchronize()

    return step


def _candidates(
    base: nn.Module, x: torch.Tensor, y: torch.Tensor, wrappers: Mapping[str, Sequence[Any] | None]
) -> dict[str, Callable[[], object]]:
    """One step function per name; ``None`` means the plain module, else DataParallel's ids."""
    out: dict[str, Callable[[], object]] = {}
    for name, ids in wrappers.items():
        module = copy.deepcopy(base)
        if ids is None:
            out[name] = _stepper(module, module, x, y)
        elif name.startswith("nn."):
            out[name] = _stepper(nn.DataParallel(module, device_ids=list(ids)), module, x, y)
        else:
            out[name] = _stepper(DataParallel(module, device_ids=list(ids)), module, x, y)
    return out


def run(quick: bool = False) -> list[BenchResult]:
    """Measure, and return one result per figure (ratios against the plain module)."""
    torch.manual_seed(0)
    width, depth, batch, inputs, classes = (
        (256, 2, 64, 128, 10) if quick else (1024, 3, 256, 512, 10)
    )
    repeat = 5 if quick else 15
    machine = machine_description()
    model = f"MLP {inputs}-{'-'.join([str(width)] * depth)}-{classes}, batch {batch}"
    results: list[BenchResult] = []

    base = _mlp(width, depth, inputs, classes)
    x, y = torch.randn(batch, inputs), torch.randint(0, classes, (batch,))
    cpu = {"plain": None, "gk 1 cpu": ["cpu"], "gk 2 cpu": ["cpu"] * 2, "gk 4 cpu": ["cpu"] * 4}
    # One intra-op thread: CPU replicas get their parallelism from one thread each, and torch's
    # own pool would otherwise compete with them (and with anything else) for the same cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = compare(_candidates(base, x, y, cpu), repeat=repeat, warmup=2)
    finally:
        torch.set_num_threads(threads)
    for name in ("gk 1 cpu", "gk 2 cpu", "gk 4 cpu"):
        replicas = name.split()[1]
        results.append(
            BenchResult(
                SUITE,
                f"step, DataParallel on {replicas} CPU replica{'s' if replicas != '1' else ''}",
                times[name] * 1e3,
                "ms",
                baseline_name="plain module",
                baseline_value=times["plain"] * 1e3,
                target="ratio < 1.05" if replicas == "1" else None,
                target_ratio=1.05 if replicas == "1" else None,
                note=model,
                extra={"machine": machine, "torch_threads": 1},
            )
        )

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        base_cuda = base.cuda()
        xc, yc = x.cuda(), y.cuda()
        ids = list(range(gpus))
        cuda = {"plain": None, "gk": ids, "nn.DataParallel": ids}
        times = compare(_candidates(base_cuda, xc, yc, cuda), repeat=repeat, warmup=3)
        for name in ("gk", "nn.DataParallel"):
            results.append(
                BenchResult(
                    SUITE,
                    f"step, {name} on {gpus} GPU{'s' if gpus > 1 else ''}",
                    times[name] * 1e3,
                    "ms",
                    baseline_name="plain module on cuda:0",
                    baseline_value=times["plain"] * 1e3,
                    note=model,
                    extra={"machine": machine},
                )
            )
        results.append(
            BenchResult(
                SUITE,
                f"step, gk vs nn.DataParallel on {gpus} GPU{'s' if gpus > 1 else ''}",
                times["gk"] * 1e3,
                "ms",
                baseline_name="nn.DataParallel",
                baseline_value=times["nn.DataParallel"] * 1e3,
                note=model,
                extra={"machine": machine},
            )
        )
    return results
