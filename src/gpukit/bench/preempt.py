"""The cost of ``Preemption.should_stop()`` per training step, against the same loop without it.

Two DDP processes (gloo on CPU, NCCL where each has a GPU) train the ddp suite's small MLP; each
round runs the same number of steps twice, without the check and with it after every step
(one all-reduce of one number), the two interleaved round after round so that a slow moment
of the machine falls on both. A third variant times the check alone: its share of the step
(the first figure) is the overhead, steadier than the second, the ratio of the two loops'
step times, where the machine's noise can be larger than the check.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist
from gpukit.bench.core import BenchResult, machine_description
from gpukit.train.preempt import Preemption

SUITE = "preempt"
_IN = 256


def _rounds(steps: int, batch: int, width: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each variant, one sample per round, the same on every rank."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(_IN, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(batch, _IN), torch.randint(0, 10, (batch,)))
    net, opt, loader = dist.prepare(
        model, opt, DataLoader(data, batch_size=batch), per_device_batch_size=batch
    )
    (x, y), *_ = list(loader)

    def step() -> None:
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    samples: dict[str, list[float]] = {"plain": [], "checked": [], "check alone": []}
    # Installed in a launched worker's main thread; never signalled here.
    with Preemption(env={}) as preemption:
        step()  # DDP's buckets are built by the first step: leave it out
        for _ in range(rounds):
            for variant, samples_of in samples.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    if variant != "check alone":
                        step()
                    if variant != "plain" and preemption.should_stop():
                        raise AssertionError("no signal was sent")
                dist.barrier()
                samples_of.append((time.perf_counter() - start) / steps)
    return samples


def run(quick: bool = False) -> list[BenchResult]:
    """The checked loop's step time against the plain loop's, in two DDP processes."""
    steps, rounds, batch, width = (10, 3, 64, 256) if quick else (20, 15, 256, 1024)
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    samples = dist.launch(_rounds, 2, steps, batch, width, rounds)[0]
    plain = statistics.median(samples["plain"])
    checked = statistics.median(samples["checked"])
    alone = statistics.median(samples["check alone"])
    model = f"MLP {_IN}-{width}-{width}-10, {batch} samples per process per step"
    rounds_said = f"{steps} steps a round, {rounds} rounds interleaved"
    return [
        BenchResult(
            suite=SUITE,
            name=f"should_stop() alone, 2 processes ({backend})",
            value=alone * 1e3,
            unit="ms",
            baseline_name="one training step",
            baseline_value=plain * 1e3,
            target="≤ 0.01",
            target_ratio=0.01,
            note=f"{model}; the check timed by itself, {rounds_said}: the ratio is its "
            "share of the step, steadier than the difference of two step times",
            extra={"per_check_us": alone * 1e6, "machine": machine_description()},
        ),
        BenchResult(
            suite=SUITE,
            name=f"step with should_stop() after it, 2 processes ({backend})",
            value=checked * 1e3,
            unit="ms",
            baseline_name="the same step without the check",
            baseline_value=plain * 1e3,
            target="≤ 1.01",
            target_ratio=1.01,
            note=f"{model}, {rounds_said}; on a shared machine the two step times "
            "differ by more than the check costs",
            extra={"machine": machine_description()},
        ),
    ]
