"""DDP training throughput with 1 vs 2 processes (gloo on CPU, NCCL where each process has a GPU).

Both runs go through ``gk.distributed.launch`` and train the same small MLP on the same per-process
batch, so the ratio shows what a second process buys once gradients are averaged over the wire.
On a CPU machine the two processes share its cores: a ratio near 1 (or below) means the machine,
not DDP, is the limit.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist
from gpukit.bench.core import BenchResult, machine_description

SUITE = "ddp"
_IN = 256


def _train(steps: int, batch: int, width: int, threads: int) -> float:
    """Samples per second over all processes, timed after a warm-up step, on every rank."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(_IN, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    samples = (steps + 1) * batch * dist.world_size()
    data = TensorDataset(torch.randn(samples, _IN), torch.randint(0, 10, (samples,)))
    loader = DataLoader(data, batch_size=batch, shuffle=False)
    net, opt, batches = dist.prepare(model, opt, loader, per_device_batch_size=batch)
    start = 0.0
    for step, (x, y) in enumerate(batches):
        if step == 1:  # the first step builds DDP's buckets: leave it out
            dist.barrier()
            start = time.perf_counter()
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    elapsed = time.perf_counter() - start
    return steps * batch * dist.world_size() / elapsed


def run(quick: bool = False) -> list[BenchResult]:
    """Throughput (samples/s) of 2 DDP processes against 1, two ways, in the same run.

    "One core per process" is the CPU analogue of one GPU against two: each process gets the
    same resources. "Cores split" gives both runs the whole machine: one process uses every
    core for its own kernels, two processes share them, so DDP only adds communication.
    """
    steps, batch, width = (5, 64, 128) if quick else (20, 256, 1024)
    cores = os.cpu_count() or 1
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    model = f"MLP {_IN}-{width}-{width}-10, {batch} samples per process per step, {steps} steps"
    configurations = [
        ("one core per process", 1, 1),
        (f"{cores} cores split between the processes", cores, max(1, cores // 2)),
    ]
    results = []
    for label, one_threads, two_threads in configurations[: 1 if quick else 2]:
        one = dist.launch(_train, 1, steps, batch, width, one_threads)[0]
        two = dist.launch(_train, 2, steps, batch, width, two_threads)[0]
        results.append(
            BenchResult(
                suite=SUITE,
                name=f"ddp 2 processes ({backend}), {label}",
                value=two,
                unit="samples/s",
                baseline_name="1 process",
                baseline_value=one,
                note=f"{model}; ratio above 1 is a speed-up",
                higher_is_better=True,
                extra={"machine": machine_description()},
            )
        )
    return results
