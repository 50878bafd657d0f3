"""Exact mode: what "the same bits on any number of processes" costs, and whether it holds.

Three measurements, each side by side in one run:

- **step time**, exact mode against the default mode at N = 2 and N = 4 with the same
  per-process micro-batch shape, both models trained in the same processes, their steps
  interleaved (a few of one, a few of the other), so that a noisy moment falls on both;
- **the per-micro-batch seeding**: ``seed_micro_batch`` (a generator's seed) against
  ``torch.manual_seed``, and as a share of one step;
- **the exactness table**: each configuration's final weights against the same configuration
  trained by one process, in the default mode and in exact mode: the largest difference, and
  whether every weight is bitwise equal (``torch.equal``); not a ratio, it is carried in the
  first result's ``extra["exactness"]`` (``gpukit bench --json``).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist
from gpukit.bench.core import BenchResult, machine_description
from gpukit.distributed.streams import seed_micro_batch

SUITE = "exact"
_IN = 256


def applies() -> str | None:
    """Why the suite cannot run here, or None when it can: on the CPU, or on 4 GPUs."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 < gpus < 4:
        return f"launches 4 processes, one per GPU, and {gpus} GPU(s) are visible"
    return None


def _mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(_IN, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def _loader(samples: int) -> DataLoader[Any]:
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(samples, _IN, generator=gen), torch.randint(0, 10, (samples,)))
    return DataLoader(data, batch_size=1, shuffle=False)


def _steps(model: nn.Module, batches: Any, count: int) -> float:
    """Seconds for ``count`` optimizer steps of a prepared loop, every rank waited for."""
    dist.barrier()
    start = time.perf_counter()
    done = 0
    for x, y in batches:
        if dist.step(nn.functional.cross_entropy(model(x), y)):
            done += 1
            if done == count:
                break
    dist.barrier()
    return time.perf_counter() - start


def _interleaved(
    default_sizes: dict[str, Any],
    global_batch: int,
    micro: int,
    width: int,
    rounds: int,
    chunk: int,
) -> list[float]:
    """Seconds per step of the default mode (prepared with ``default_sizes``) and of exact
    mode (``global_batch`` cut into ``micro``), their steps interleaved ``chunk`` at a time."""
    torch.set_num_threads(1)
    samples = global_batch * (rounds * chunk + 2)
    runs: list[tuple[nn.Module, Iterator[Any]]] = []
    exact: dict[str, Any] = {"exact": True, "micro_batch_size": micro}
    for sizes in (default_sizes, exact):
        model = _mlp(width)
        prepared, _, loader = dist.prepare(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01),
            _loader(samples),
            global_batch_size=global_batch,
            **sizes,
        )
        runs.append((prepared, iter(loader)))
    totals = [0.0, 0.0]
    for net, batches in runs:  # a warm-up step each: DDP's buckets, first allocations
        _steps(net, batches, 1)
    for _ in range(rounds):
        for index, (net, batches) in enumerate(runs):
            totals[index] += _steps(net, batches, chunk)
    return [total / (rounds * chunk) for total in totals]


def _step_times(micro: int, per_process: int, width: int, rounds: int, chunk: int) -> list[float]:
    """Seconds per step of the default mode and of exact mode with the same micro-batches."""
    global_batch = micro * per_process * dist.world_size()
    return _interleaved({"per_device_batch_size": micro}, global_batch, micro, width, rounds, chunk)


def _one_process_cut(micro: int, micro_batches: int, width: int, rounds: int) -> list[float]:
    """One process: seconds per step of one batch of ``micro * micro_batches`` (the default
    mode) and of exact mode's ``micro_batches`` micro-batches of ``micro``."""
    return _interleaved({}, micro * micro_batches, micro, width, rounds, 2)


def _seeding_cost(calls: int) -> tuple[float, float]:
    """Microseconds per call of ``seed_micro_batch`` and of ``torch.manual_seed``."""
    cpu = torch.device("cpu")
    times = [0.0, 0.0]
    for _ in range(5):  # interleaved
        start = time.perf_counter()
        for position in range(calls):
            seed_micro_batch(cpu, 0, 0, position)
        times[0] += time.perf_counter() - start
        start = time.perf_counter()
        for position in range(calls):
            torch.manual_seed(position)
        times[1] += time.perf_counter() - start
    return times[0] / (5 * calls) * 1e6, times[1] / (5 * calls) * 1e6


@dataclass(frozen=True)
class Row:
    """One configuration of the exactness table."""

    label: str
    world_size: int
    dtype: str = "float32"
    precision: str = "fp32"
    dropout: float = 0.0
    global_batch: int = 16
    micro: int = 4
    resume_from: int | None = None  # trained on this many processes, then resumed on world_size


_SAMPLES = 70  # steps of 16 and a short last one of 6


def _tiny(row: Row) -> nn.Module:
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Linear(6, 32), nn.GELU(), nn.Dropout(row.dropout), nn.Linear(32, 32),
        nn.LayerNorm(32), nn.Linear(32, 3),
    )  # fmt: skip
    return model.to(getattr(torch, row.dtype))


def _train(row: Row, exact: bool, folder: str | None = None, stop: int | None = None) -> Any:
    """Two epochs of ``row`` in this process of the group; the weights, or None at ``stop``."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(_SAMPLES, 6, generator=gen, dtype=getattr(torch, row.dtype))
    y = torch.randint(0, 3, (_SAMPLES,), generator=gen)
    model = _tiny(row)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(x, y), batch_size=1, shuffle=True)
    torch.manual_seed(5)  # the default mode's dropout draws from each process's own stream
    sizes: dict[str, Any] = {"global_batch_size": row.global_batch}
    if exact:
        sizes.update(exact=True, micro_batch_size=row.micro)
    prepared, opt, batches = dist.prepare(
        model, opt, loader, precision=row.precision, seed=11, **sizes
    )
    state = None
    if folder is not None:
        from gpukit.train import TrainingState

        state = TrainingState(folder, model=prepared, optimizer=opt, loader=batches)
        state.resume()
    prepared.train()
    while batches.epoch < 2:
        for xb, yb in batches:
            stepped = dist.step(nn.functional.cross_entropy(prepared(xb).float(), yb))
            if stepped and state is not None and state.step == stop:
                state.save()
                state.wait()
                return None
    inner = (
        prepared.module if isinstance(prepared, nn.parallel.DistributedDataParallel) else prepared
    )
    return [p.detach().clone() for p in inner.parameters()]


def _weights(row: Row, exact: bool, world_size: int, folder: str | None, stop: int | None) -> Any:
    if world_size == 1:
        return _train(row, exact, folder, stop)
    return dist.launch(_train, world_size, row, exact, folder, stop)[0]


def _compare(row: Row, exact: bool) -> tuple[float, bool]:
    """The largest difference from one process, and whether every weight is bitwise equal."""
    reference = _weights(row, exact, 1, None, None)
    if row.resume_from is not None:
        with tempfile.TemporaryDirectory() as folder:
            _weights(row, exact, row.resume_from, folder, 4)
            got = _weights(row, exact, row.world_size, folder, None)
    else:
        got = _weights(row, exact, row.world_size, None, None)
    largest = max(
        float((a.double() - b.double()).abs().max()) for a, b in zip(got, reference, strict=True)
    )
    return largest, all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))


def exactness(quick: bool = False) -> list[dict[str, Any]]:
    """The exactness table: per configuration, each mode's largest difference from one
    process and whether every weight is bitwise equal.

    Args:
        quick: measure one configuration only.
    """
    table = []
    for row in exactness_rows(quick):
        default_diff, default_equal = _compare(row, exact=False)
        exact_diff, exact_equal = _compare(row, exact=True)
        table.append(
            {
                "configuration": row.label,
                "default_max_difference": default_diff,
                "default_bitwise": default_equal,
                "exact_max_difference": exact_diff,
                "exact_bitwise": exact_equal,
            }
        )
    return table


def exactness_rows(quick: bool = False) -> list[Row]:
    """The table's configurations (the quick run keeps one per kind)."""
    rows = [
        Row("float64, N = 2", 2, dtype="float64"),
        Row("float64, N = 3 (48 / 8: N in 1, 3, 6)", 3, dtype="float64", global_batch=48, micro=8),
        Row("float64, N = 4", 4, dtype="float64"),
        Row("float32, N = 2", 2),
        Row("float32, N = 4", 4),
        Row("bf16-mixed, N = 2", 2, precision="bf16-mixed"),
        Row("bf16-mixed, N = 4", 4, precision="bf16-mixed"),
        Row("dropout 0.1, float32, N = 2", 2, dropout=0.1),
        Row("dropout 0.1, float32, N = 4", 4, dropout=0.1),
        Row("resume 2 -> 1, float32, dropout 0.1", 1, dropout=0.1, resume_from=2),
        Row("resume 4 -> 2, bf16-mixed", 2, precision="bf16-mixed", resume_from=4),
    ]
    return [rows[7]] if quick else rows


def run(quick: bool = False) -> list[BenchResult]:
    """Exact mode's step time against the default mode, its seeding, its exactness table."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    machine = machine_description()
    micro, per_process, width = (16, 1, 128) if quick else (64, 2, 1024)
    rounds, chunk = (2, 2) if quick else (6, 4)
    results = []
    step_time = {}
    for n in (2, 4):
        normal, exact = dist.launch(_step_times, n, micro, per_process, width, rounds, chunk)[0]
        step_time[n] = exact
        results.append(
            BenchResult(
                suite=SUITE,
                name=f"exact mode step, {n} processes (gloo)",
                value=exact * 1e3,
                unit="ms/step",
                baseline_name="default mode, same micro-batches",
                baseline_value=normal * 1e3,
                target="<= 1.15",
                target_ratio=1.15,
                note=f"MLP {_IN}-{width}-{width}-10, {per_process} micro-batches of {micro} per "
                "process per step, one thread per process; steps interleaved",
                extra={"machine": machine},
            )
        )
    micro_batches = 4 * per_process  # what N = 4 runs per process, on one process
    normal, exact = dist.launch(_one_process_cut, 1, micro, micro_batches, width, rounds)[0]
    results.append(
        BenchResult(
            suite=SUITE,
            name=f"exact mode step, 1 process, {micro_batches} micro-batches of {micro}",
            value=exact * 1e3,
            unit="ms/step",
            baseline_name=f"default mode, one batch of {micro * micro_batches}",
            baseline_value=normal * 1e3,
            note="what a smaller N pays for exact mode's fixed micro-batch size",
            extra={"machine": machine},
        )
    )
    ours, manual = _seeding_cost(2_000 if quick else 20_000)
    step_us = step_time[2] * 1e6 / per_process
    results.append(
        BenchResult(
            suite=SUITE,
            name="per-micro-batch seeding",
            value=ours,
            unit="us/call",
            baseline_name="torch.manual_seed",
            baseline_value=manual,
            note=f"{ours / step_us:.3%} of a micro-batch's step time at 2 processes "
            f"({step_us / 1e3:.1f} ms)",
            extra={"share_of_step": ours / step_us, "machine": machine},
        )
    )
    # The table is not a ratio (its exact column is 0 by design): it rides with the first row.
    results[0].extra["exactness"] = exactness(quick)
    return results
