"""The training step: exact accumulation against a hand-written ``no_sync`` loop, and precision.

- **Accumulation.** An optimizer step of K=4 micro-batches through ``prepare(accumulate=4)`` and
  ``dist.step(loss)`` (weights per micro-batch, the sync flag, the weighted all-reduce) against
  the loop users write by hand: ``loss / K``, ``with model.no_sync()`` on all but the last
  micro-batch, DDP's own average. In one process (no group) and in 2 launched processes (gloo).
  Target: at most 1.02x the hand-written loop's step time.
- **Precision.** A training step under bf16 autocast against fp32, on the CPU: the figure behind
  ``precision="auto"`` on a CPU (:func:`gpukit.train.precision.cpu_has_native_bf16`; run it with
  ``ONEDNN_MAX_CPU_ISA=AVX2`` to see a CPU without bf16 instructions); and where CUDA exists,
  fp16 and bf16 against fp32 on the GPU.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist
from gpukit.bench.core import BenchResult, compare, machine_description
from gpukit.train.precision import cpu_has_native_bf16

SUITE = "train"
K = 4

__all__ = ["run"]


def _mlp(inputs: int, width: int, classes: int = 10) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, classes),
    )  # fmt: skip


def _data(samples: int, inputs: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(samples, inputs, generator=gen), torch.randint(0, 10, (samples,), generator=gen)
    )


def _forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def _gpukit_loop(micro: int, inputs: int, width: int) -> Callable[[], object]:
    """One optimizer step (K micro-batches) per call, through prepare() and dist.step."""
    model = _mlp(inputs, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(_data(micro * K * dist.world_size() * 8, inputs), batch_size=micro)
    net, opt, batches = dist.prepare(model, opt, loader, per_device_batch_size=micro, accumulate=K)
    stream = _forever(batches)

    def step() -> None:
        for _ in range(K):
            x, y = next(stream)
            dist.step(nn.functional.cross_entropy(net(x), y))

    return step


def _gpukit_batches(micro: int, inputs: int) -> Any:
    """gpukit's loader of the same batches, prepared beside a model that is not trained."""
    spare = _mlp(inputs, 8)
    loader = DataLoader(_data(micro * K * dist.world_size() * 8, inputs), batch_size=micro)
    _, _, batches = dist.prepare(
        spare, torch.optim.SGD(spare.parameters()), loader, per_device_batch_size=micro
    )
    return batches


def _hand_written_loop(
    micro: int, inputs: int, width: int, *, gpukit_loader: bool = False
) -> Callable[[], object]:
    """The same step as users write it: loss / K, no_sync on all but the last micro-batch.

    With ``gpukit_loader`` its batches come from gpukit's loader: the step alone then differs.
    """
    model = _mlp(inputs, width)
    net: nn.Module = model
    if dist.world_size() > 1:
        net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if gpukit_loader:
        stream = _forever(_gpukit_batches(micro, inputs))
    else:
        data = _data(micro * K * dist.world_size() * 8, inputs)
        sampler: torch.utils.data.Sampler[int] | None = None
        if dist.world_size() > 1:
            sampler = torch.utils.data.DistributedSampler(data)
        stream = _forever(DataLoader(data, batch_size=micro, sampler=sampler))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for k in range(K):
            x, y = next(stream)
            last = k == K - 1
            with (
                net.no_sync()
                if isinstance(net, nn.parallel.DistributedDataParallel) and not last
                else contextlib.nullcontext()
            ):
                loss = nn.functional.cross_entropy(net(x), y) / K
                torch.autograd.backward(loss)
        opt.step()

    return step


Loops = tuple[float, float, float]
"""Median CPU seconds per step: gpukit, hand-written, hand-written over gpukit's loader."""


def _accumulation_ratio(micro: int, inputs: int, width: int, repeat: int) -> Loops:
    """Median CPU seconds per optimizer step of each loop (:data:`Loops`), interleaved, on
    every rank.

    CPU time of the process (every thread), not wall time: on a machine whose cores other
    processes share, wall time mostly measures who else ran; one compute thread per process.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _timed_loops(micro, inputs, width, repeat)
    finally:
        torch.set_num_threads(threads)


def _timed_loops(micro: int, inputs: int, width: int, repeat: int) -> Loops:
    candidates = {
        "gpukit": _gpukit_loop(micro, inputs, width),
        "hand": _hand_written_loop(micro, inputs, width),
        "hand, gpukit's loader": _hand_written_loop(micro, inputs, width, gpukit_loader=True),
    }
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():
        fn()
        fn()
    for i in range(repeat):
        # Forwards, then backwards: whatever running after another loop costs falls on each.
        order = list(candidates.items()) if i % 2 == 0 else list(reversed(candidates.items()))
        for name, fn in order:
            if dist.world_size() > 1:
                dist.barrier()  # collectives pace the ranks: start each loop together
            start = time.process_time()
            fn()
            fn()
            samples[name].append((time.process_time() - start) / 2)
    gpukit, hand, over_loader = (statistics.median(found) for found in samples.values())
    return gpukit, hand, over_loader


def _precision_step(
    device: torch.device, dtype: torch.dtype | None, batch: int, inputs: int, width: int
) -> Callable[[], object]:
    model = _mlp(inputs, width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    x = torch.randn(batch, inputs, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        context = (
            torch.autocast(device.type, dtype=dtype)
            if dtype is not None
            else contextlib.nullcontext()
        )
        with context:
            out = model(x)
        loss = nn.functional.cross_entropy(out.float(), y)
        if scaler is not None:
            torch.autograd.backward(scaler.scale(loss))
            scaler.step(opt)
            scaler.update()
        else:
            torch.autograd.backward(loss)
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def _precision_results(quick: bool, machine: dict[str, Any]) -> list[BenchResult]:
    batch, inputs, width = (64, 256, 256) if quick else (256, 512, 1024)
    repeat = 5 if quick else 15
    model = f"MLP {inputs}-{width}-{width}-10, batch {batch}, forward + backward + SGD"
    results = []
    cpu = torch.device("cpu")
    times = compare(
        {
            "bf16": _precision_step(cpu, torch.bfloat16, batch, inputs, width),
            "fp32": _precision_step(cpu, None, batch, inputs, width),
        },
        repeat=repeat,
        number=2,
    )
    results.append(
        BenchResult(
            suite=SUITE,
            name="bf16 autocast step on the CPU",
            value=times["bf16"] * 1e3,
            unit="ms",
            baseline_name="fp32 step",
            baseline_value=times["fp32"] * 1e3,
            note=f"{model}; this CPU "
            + (
                "has bf16 instructions (AVX512-BF16 or AMX): precision='auto' picks bf16 here"
                if cpu_has_native_bf16()
                else "has no bf16 instructions: precision='auto' picks fp32 here"
            ),
            extra={"machine": machine},
        )
    )
    if torch.cuda.is_available():
        gpu = torch.device("cuda:0")
        batch, width = (256, 1024) if quick else (4096, 4096)
        candidates = {"fp32": _precision_step(gpu, None, batch, inputs, width)}
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            candidates[name] = _precision_step(gpu, dtype, batch, inputs, width)
        times = compare(candidates, repeat=repeat, number=5, warmup=3)
        for name in ("fp16", "bf16"):
            results.append(
                BenchResult(
                    suite=SUITE,
                    name=f"{name} autocast step on {torch.cuda.get_device_name(0)}",
                    value=times[name] * 1e3,
                    unit="ms",
                    baseline_name="fp32 step",
                    baseline_value=times["fp32"] * 1e3,
                    note=f"MLP {inputs}-{width}-{width}-10, batch {batch}; below 1 is a speed-up",
                    extra={"machine": machine},
                )
            )
    return results


def run(quick: bool = False) -> list[BenchResult]:
    """Accumulation against a hand-written no_sync loop (1 and 2 processes), then precision."""
    micro, inputs, width = (32, 128, 256) if quick else (64, 512, 1024)
    repeat = 5 if quick else 25
    machine = machine_description()
    model = f"MLP {inputs}-{width}-{width}-10, {K} micro-batches of {micro} per step per process"
    one = _accumulation_ratio(micro, inputs, width, repeat)
    runs = [("1 process, no group", one)]
    if not quick:
        ranks = dist.launch(_accumulation_ratio, 2, micro, inputs, width, repeat)
        two = (
            statistics.mean(r[0] for r in ranks),
            statistics.mean(r[1] for r in ranks),
            statistics.mean(r[2] for r in ranks),
        )
        runs.append(("2 processes (gloo), one core each, mean of the ranks", two))
    results: list[BenchResult] = []
    for label, (gpukit, hand, over_loader) in runs:
        results.append(
            BenchResult(
                suite=SUITE,
                name=f"exact accumulation step, {label}",
                value=gpukit * 1e3,
                unit="ms CPU",
                baseline_name="hand-written no_sync loop",
                baseline_value=hand * 1e3,
                target="<= 1.02x",
                target_ratio=1.02,
                note=f"{model}; gpukit also weighs micro-batches exactly, the hand loop divides "
                "by K",
                extra={"machine": machine},
            )
        )
        # The same comparison with the loader taken out: what dist.step itself costs.
        results.append(
            BenchResult(
                suite=SUITE,
                name=f"exact accumulation step over the same loader, {label}",
                value=gpukit * 1e3,
                unit="ms CPU",
                baseline_name="hand-written no_sync loop over gpukit's loader",
                baseline_value=over_loader * 1e3,
                note=f"{model}; both loops read gpukit's loader, only the step differs",
                extra={"machine": machine},
            )
        )
    return results + _precision_results(quick, machine)
