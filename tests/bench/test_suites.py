"""Every benchmark suite runs in quick mode and reports figures against an alternative."""

from __future__ import annotations

import importlib
import math

import pytest

from gpukit.cli.bench import SUITES
from tests.conftest import skip_without_bench_extra


@pytest.mark.slow
@pytest.mark.parametrize("suite", [name for name in SUITES if name != "transfer"])
def test_suite_reports_positive_figures_against_an_alternative(suite: str) -> None:
    module = importlib.import_module(SUITES[suite])
    reason = module.applies() if hasattr(module, "applies") else None
    if reason:
        pytest.skip(reason)
    try:
        results = module.run(quick=True)
    except ImportError as exc:
        skip_without_bench_extra(exc)
    assert results
    for result in results:
        assert result.suite == suite
        assert result.value > 0
        assert math.isfinite(result.value)
        assert result.baseline_name
        assert result.ratio is not None
        assert result.ratio > 0
