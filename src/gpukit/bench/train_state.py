"""The training state: how long a save blocks the loop, and what a resume late in an epoch costs.

An asynchronous ``TrainingState.save`` blocks the training loop only while it copies the state
to host memory; a background thread then writes and fsyncs it. It is measured against a
synchronous save of the same state (the same files, written and fsynced before returning),
interleaved with it. The write of the asynchronous save is waited for outside the timed part.

A resume is index arithmetic: resuming at batch 10,000 of an epoch should cost what resuming at
batch 10 costs. Each is timed from a fresh ``TrainingState.resume`` to the first batch in hand.

A resume verifies every file of the save it takes against the digest in its marker before any
loader reads it. What that costs is measured on a 1 GiB state (weights and Adam's moments; 64
MiB quick) against the same resume with the verification left out, interleaved with it.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit.train.saves as saves
from gpukit.bench.core import BenchResult
from gpukit.distributed.data import DistributedLoader
from gpukit.train import TrainingState

SUITE = "train_state"
_WIDTH = 1024  # one Linear(1024, 1024) holds 4 MiB of float32 weights
_BATCH = 8


def _model(total_bytes: int) -> nn.Module:
    layers = max(1, round(total_bytes / (_WIDTH * _WIDTH * 4)))
    return nn.Sequential(*(nn.Linear(_WIDTH, _WIDTH) for _ in range(layers)))


def _interleaved(candidates: dict[str, Callable[[], float]], repeat: int) -> dict[str, float]:
    """Median of what each candidate reports (seconds), called round-robin."""
    for measure in candidates.values():
        measure()  # warm-up: first allocations, imports
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeat):
        for name, measure in candidates.items():
            samples[name].append(measure())
    return {name: statistics.median(values) for name, values in samples.items()}


def _blocking(folder: Path, model_bytes: int, repeat: int) -> list[BenchResult]:
    model = _model(model_bytes)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, _WIDTH)).sum().backward()
    optimizer.step()  # Adam's two moments: the state is three times the weights
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    state = TrainingState(folder, model=model, optimizer=optimizer, keep=2)

    def asynchronous() -> float:
        start = time.perf_counter()
        state.save()
        blocked = time.perf_counter() - start
        state.wait()  # the write goes on in the background; not the loop's time
        return blocked

    def synchronous() -> float:
        start = time.perf_counter()
        state.save(asynchronous=False)
        return time.perf_counter() - start

    with state:
        times = _interleaved({"async": asynchronous, "sync": synchronous}, repeat)
    return [
        BenchResult(
            SUITE,
            "save: time the loop is blocked (asynchronous)",
            times["async"],
            "s",
            "synchronous save of the same state",
            times["sync"],
            target="<= 0.2x",
            target_ratio=0.2,
            note=f"{size / 2**20:.0f} MiB of state (float32 weights and Adam's moments), "
            "written and fsynced into a new folder per save",
            extra={"bytes": size},
        )
    ]


def _loader(samples: int) -> DistributedLoader:
    data = TensorDataset(torch.arange(samples))
    inner = DataLoader(data, batch_size=_BATCH, shuffle=True)
    return DistributedLoader(
        inner, batch_size=_BATCH, rank=0, world_size=1, device=torch.device("cpu"), seed=0
    )


def _resume(folder: Path, batches: int, repeat: int) -> list[BenchResult]:
    samples = _BATCH * batches
    model = nn.Linear(4, 4)
    folders = {}
    for at in (10, 10_000):
        loader = _loader(samples)
        loader.load_state_dict({**loader.state_dict(), "consumed": at * _BATCH})
        folders[at] = folder / f"at-{at}"
        with TrainingState(folders[at], model=model, loader=loader, asynchronous=False) as state:
            state.save()

    def resume_at(at: int) -> Callable[[], float]:
        def measure() -> float:
            loader = _loader(samples)
            start = time.perf_counter()
            with TrainingState(folders[at], model=model, loader=loader) as state:
                state.resume()
            next(iter(loader))
            return time.perf_counter() - start

        return measure

    def replay() -> float:
        """Skipping by iterating, as accelerate's ``skip_first_batches`` does."""
        loader = _loader(samples)
        start = time.perf_counter()
        batches = iter(loader)
        for _ in range(10_000):
            next(batches)
        next(batches)
        return time.perf_counter() - start

    times = _interleaved(
        {"10": resume_at(10), "10000": resume_at(10_000), "replay": replay}, repeat
    )
    return [
        BenchResult(
            SUITE,
            "resume at batch 10,000 of an epoch, to the first batch",
            times["10000"],
            "s",
            "resume at batch 10",
            times["10"],
            target="equal within noise (<= 1.1x)",
            target_ratio=1.1,
            note=f"an epoch of {batches:,} shuffled batches of {_BATCH}; the loader's position "
            "is index arithmetic, nothing before it is loaded again",
            extra={"batches_per_epoch": batches},
        ),
        BenchResult(
            SUITE,
            "resume at batch 10,000 of an epoch, to the first batch",
            times["10000"],
            "s",
            "replaying the 10,000 batches before it",
            times["replay"],
            note=f"an epoch of {batches:,} shuffled batches of {_BATCH}; the loader's position "
            "is index arithmetic, nothing before it is loaded again",
            extra={"batches_per_epoch": batches},
        ),
    ]


@contextlib.contextmanager
def _unverified() -> Iterator[None]:
    """Resumes in this block skip the digests: the baseline, never a user's path."""
    real = saves.verify
    saves.verify = lambda info: None
    try:
        yield
    finally:
        saves.verify = real


def _verification(folder: Path, state_bytes: int, repeat: int) -> list[BenchResult]:
    model = _model(state_bytes // 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, _WIDTH)).sum().backward()
    optimizer.step()
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    with TrainingState(folder, model=model, optimizer=optimizer, asynchronous=False) as state:
        state.save()

    def resume() -> float:
        start = time.perf_counter()
        with TrainingState(folder, model=model, optimizer=optimizer) as state:
            state.resume()
        return time.perf_counter() - start

    def unverified() -> float:
        with _unverified():
            return resume()

    times = _interleaved({"verified": resume, "unverified": unverified}, repeat)
    return [
        BenchResult(
            SUITE,
            "resume, every file's digest verified first",
            times["verified"],
            "s",
            "the same resume without the digests",
            times["unverified"],
            target="<= 1.1x",
            target_ratio=1.1,
            note=f"{size / 2**30:.2f} GiB of state (float32 weights and Adam's moments), in the "
            "page cache as after a save; XXH3-128 over a memory map of each file",
            extra={"bytes": size},
        )
    ]


def run(quick: bool = False) -> list[BenchResult]:
    """Time the blocking part of a save (~300 MiB of state; ~50 MiB quick), two resumes, and
    a resume's digests (1 GiB of state; 64 MiB quick)."""
    repeat = 5 if quick else 9
    with tempfile.TemporaryDirectory(prefix="gpukit-bench-") as folder:
        base = Path(folder)
        blocking = _blocking(base / "saves", (16 if quick else 96) * 2**20, repeat)
        resume = _resume(base / "resume", 20_000, repeat)
        digests = _verification(base / "digests", (64 if quick else 1024) * 2**20, repeat)
    return [*blocking, *resume, *digests]
