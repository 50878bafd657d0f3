"""Timing helpers shared by the benchmark suites."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from gpukit.errors import InvalidArgumentError


@dataclass(frozen=True)
class BenchResult:
    """One measured figure, and the alternative it was measured against.

    ``ratio`` is ``value / baseline_value``. For times and memory (``higher_is_better``
    False) below 1 means gpukit (or the first option) took less than the alternative; for a
    rate or a size found (``higher_is_better`` True) above 1 is the better result.
    ``target`` is the goal as the table prints it; ``target_ratio`` (a ratio) or
    ``target_value`` (in ``unit``) is the same goal as a number, drawn as the target mark on
    ``gpukit bench --plot``.

    Args:
        suite: the suite that measured it (``"transfer"``).
        name: what was measured, as the table's row names it.
        value: the figure, in ``unit``.
        unit: its unit (``"us/call"``, ``"GB/s"``...).
        baseline_name: the alternative measured against; None: none.
        baseline_value: the alternative's figure, in ``unit``; None: none.
        target: the goal as the table prints it (``"<= 1.1"``); None: no goal.
        note: a remark printed with the row (``""``: none).
        extra: further figures by name.
        higher_is_better: whether a larger value is the better one (False: times, memory).
        target_ratio: the goal as a ratio to ``baseline_value``; None: none.
        target_value: the goal in ``unit``; None: none.
    """

    suite: str
    name: str
    value: float
    unit: str
    baseline_name: str | None = None
    baseline_value: float | None = None
    target: str | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    higher_is_better: bool = False
    target_ratio: float | None = None
    target_value: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.baseline_value in (None, 0):
            return None
        assert self.baseline_value is not None
        return self.value / self.baseline_value

    @property
    def target_as_ratio(self) -> float | None:
        """The goal on the ratio's scale: ``target_ratio``, or ``target_value`` divided by
        the alternative's value; None without a numeric goal."""
        if self.target_ratio is not None:
            return self.target_ratio
        if self.target_value is None or self.baseline_value in (None, 0):
            return None
        assert self.baseline_value is not None
        return self.target_value / self.baseline_value

    def to_json(self) -> dict[str, Any]:
        """A plain dict, with the ratio included."""
        data = asdict(self)
        data["ratio"] = self.ratio
        return data


def _count(name: str, value: object, minimum: int) -> int:
    """``value``, a whole number from ``minimum``; else an InvalidArgumentError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(
            f"{name}={value!r} is not a whole number from {minimum}.",
            hint=f"Pass {name} as an int >= {minimum}.",
        )
    return value


def time_call(fn: Callable[[], object], *, number: int = 1) -> float:
    """Seconds per call of ``fn``, averaged over ``number`` back-to-back calls.

    Args:
        fn: the call to time.
        number: back-to-back calls averaged over, 1 or more.

    Raises:
        InvalidArgumentError: ``number`` is not a whole number from 1.
    """
    _count("number", number, 1)
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def compare(
    candidates: dict[str, Callable[[], object]],
    *,
    repeat: int = 7,
    number: int = 1,
    warmup: int = 1,
) -> dict[str, float]:
    """Median seconds per call for each candidate, measured round-robin.

    Interleaving the candidates (a, b, c, a, b, c, ...) spreads slow moments of a noisy machine
    over all of them, so their ratio is far steadier than that of back-to-back runs.

    Args:
        candidates: the calls to time, by name.
        repeat: rounds of measurement; the median of each candidate's is returned.
        number: back-to-back calls per measurement.
        warmup: untimed calls of each candidate before the measurement.

    Raises:
        InvalidArgumentError: ``repeat`` or ``number`` is not a whole number from 1, or
            ``warmup`` from 0.
    """
    _count("repeat", repeat, 1)
    _count("number", number, 1)
    _count("warmup", warmup, 0)
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            for name, fn in candidates.items():
                samples[name].append(time_call(fn, number=number))
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: statistics.median(times) for name, times in samples.items()}


def machine_description() -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, Python, torch, GPUs."""
    import torch

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpus": gpus,
    }
