"""Measurements of this machine and of gpukit against the alternatives.

Each suite is a module here with ``run(quick: bool = False) -> list[BenchResult]``. Results are
ratios against an alternative measured in the same run, interleaved, because these machines are
noisy; absolute times are reported beside them for context only.
"""

from gpukit.bench.core import BenchResult, compare, machine_description, time_call

__all__ = ["BenchResult", "compare", "machine_description", "time_call"]
