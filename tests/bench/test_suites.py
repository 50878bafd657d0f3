"""Every benchmark suite runs in quick mode and reports figures against an alternative."""

from __future__ import annotations

import importlib
import logging
import math

import pytest

from gpukit.bench.core import BenchResult
from gpukit.cli.bench import SUITES
from tests.helpers import skip_without_bench_extra


def _assert_figures_against_an_alternative(results: list[BenchResult], suite: str) -> None:
    assert results
    for result in results:
        assert result.suite == suite
        assert result.value > 0
        assert math.isfinite(result.value)
        assert result.baseline_name
        assert result.ratio is not None
        assert result.ratio > 0


# The shard suite starts eight process groups: its own test below checks these figures too.
@pytest.mark.slow
@pytest.mark.parametrize("suite", [name for name in SUITES if name not in ("transfer", "shard")])
def test_suite_reports_positive_figures_against_an_alternative(suite: str) -> None:
    module = importlib.import_module(SUITES[suite])
    reason = module.applies() if hasattr(module, "applies") else None
    if reason:
        pytest.skip(reason)
    try:
        results = module.run(quick=True)
    except ImportError as exc:
        skip_without_bench_extra(exc)
    _assert_figures_against_an_alternative(results, suite)


def test_a_larger_batch_found_counts_as_better_and_fewer_tries_too() -> None:
    from gpukit.bench import batch_size

    memory_log = logging.getLogger("gpukit.memory")
    try:
        results = batch_size.run(quick=True)
    except ImportError as exc:
        skip_without_bench_extra(exc)
    way = {r.name.split(",")[0]: r.higher_is_better for r in results}
    assert way == {"size found": True, "tries": False}
    # The suite quiets the search's log for its run, not for the program that ran it.
    assert memory_log.level == logging.NOTSET


def test_startup_goals_are_numbers_the_plot_can_mark() -> None:
    from gpukit.bench.startup import _TORCH, _results

    times = {"gpukit list --json": 0.1, "gpukit queue --json": 0.2, _TORCH: 1.0, "gpustat": 0.5}
    codes = dict.fromkeys(times, 0)
    goals = {(r.name, r.baseline_name): (r.target, r.target_ratio) for r in _results(times, codes)}
    assert goals[("gpukit list --json", _TORCH)] == ("< 0.15", 0.15)
    assert goals[("gpukit queue --json", _TORCH)] == ("< 0.2", 0.2)
    assert goals[("gpukit list --json", "gpustat")] == ("<= 1", 1.0)


@pytest.mark.slow
def test_the_shard_suite_finds_each_of_two_processes_holding_half_the_tensors_of_ddp() -> None:
    from gpukit.bench import shard

    found = shard.run(quick=True)
    _assert_figures_against_an_alternative(found, "shard")
    results = {r.name: r for r in found}
    tensors = "parameters + gradients + optimizer state per process"
    assert results[f"sharded, 1 process: {tensors}"].ratio == 1.0
    # 4 blocks of 256 x 256 + 256 float32 split 128 + 128 rows: half, but for AdamW's step
    # counters (one 8-byte scalar per parameter, held whole by every process).
    assert results[f"sharded, 2 processes: {tensors}"].ratio == pytest.approx(0.5, abs=1e-5)
