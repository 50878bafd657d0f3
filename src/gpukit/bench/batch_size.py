"""Batch-size search: gk.find_batch_size vs accelerate's find_executable_batch_size.

Both run against the same simulated memory limit (a step that raises torch.OutOfMemoryError
above it). Reported per limit: the tries each used, the size each found (the largest size that
fits is the limit), and the batch elements pushed through failed and successful tries, a proxy
for the time a real search spends. accelerate starts from a guess (here ``maximum``) and
shrinks by 10% per failure; gpukit grows from 1 and bisects.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from unittest import mock

import torch

import gpukit.memory.batch_size as _batch_size
from gpukit.bench.core import BenchResult
from gpukit.memory.batch_size import find_batch_size

SUITE = "batch_size"
MAXIMUM = 4096


class _Limit:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.tried: list[int] = []

    def __call__(self, batch_size: int) -> None:
        self.tried.append(batch_size)
        if batch_size > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried {batch_size} (simulated).")


def _gpukit(limit: int) -> tuple[int, list[int]]:
    step = _Limit(limit)
    return find_batch_size(step, start=1, maximum=MAXIMUM), step.tried


def _accelerate(limit: int) -> tuple[int, list[int]]:
    from accelerate.utils import find_executable_batch_size

    step = _Limit(limit)
    found: list[int] = []

    @find_executable_batch_size(starting_batch_size=MAXIMUM)  # type: ignore[untyped-decorator]
    def run(batch_size: int) -> None:
        step(batch_size)
        found.append(batch_size)

    run()
    return found[-1], step.tried


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """Only warnings from ``logger`` while the block runs; its own level again after."""
    previous = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(previous)


def run(quick: bool = False) -> list[BenchResult]:
    """Tries and size found by both searches, for several simulated memory limits."""
    limits = [100, 1000] if quick else [7, 100, 333, 1000, 2500, 4000]
    results: list[BenchResult] = []
    # The searches' own garbage collections cost far more than the simulated steps and say
    # nothing about the strategy: turn them off in both.
    # Each try's log line is noise here; quieted for the run only, not for the caller.
    with (
        mock.patch.object(_batch_size, "_free_between_tries", return_value=None),
        mock.patch("accelerate.utils.memory.clear_device_cache", return_value=None),
        _quiet(logging.getLogger("gpukit.memory")),
    ):
        for limit in limits:
            ours, our_tries = _gpukit(limit)
            theirs, their_tries = _accelerate(limit)
            extra = {
                "limit": limit,
                "gpukit_found": ours,
                "accelerate_found": theirs,
                "gpukit_elements": sum(our_tries),
                "accelerate_elements": sum(their_tries),
            }
            results.append(
                BenchResult(
                    suite=SUITE,
                    name=f"tries, limit {limit}",
                    value=len(our_tries),
                    unit="tries",
                    baseline_name="accelerate find_executable_batch_size",
                    baseline_value=len(their_tries),
                    note=f"found {ours} vs {theirs} (largest that fits: {limit})",
                    extra=extra,
                )
            )
            results.append(
                BenchResult(
                    suite=SUITE,
                    name=f"size found, limit {limit}",
                    value=ours,
                    unit="batch",
                    baseline_name="accelerate find_executable_batch_size",
                    baseline_value=theirs,
                    note="ratio above 1: gpukit found a larger batch",
                    higher_is_better=True,
                    extra=extra,
                )
            )
    return results
