"""Peak memory of a block of code: ``gk.track_peak``.

CUDA peaks come from the caching allocator's statistics; CPU peaks from the process's peak
resident set (``VmHWM``), which Linux lets a process reset through ``/proc/self/clear_refs``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from gpukit.devices import DeviceLike
from gpukit.devices import device as _parse_device
from gpukit.errors import InvalidArgumentError
from gpukit.memory.stats import proc_memory, reset_peak_rss

__all__ = ["PeakMemory", "track_peak"]


@dataclass
class PeakMemory:
    """The memory of one ``track_peak`` block, in bytes, filled in when the block ends.

    CUDA: allocated bytes; CPU: the process's resident set. ``peak`` is ``None`` when the
    system gives no way to measure it (a CPU peak that never rose above the process's earlier
    peak, where the peak cannot be reset).

    Args:
        device: the device measured (``"cuda:0"``, ``"cpu"``).
        start: the memory in use when the block started; None until it does.
        end: the memory in use when the block ended; None until it does.
        peak: the most in use during the block; None until it ends, or where unmeasurable.
    """

    device: str
    start: int | None = None
    end: int | None = None
    peak: int | None = None

    @property
    def increase(self) -> int | None:
        """How far the peak rose above the memory in use when the block started."""
        if self.peak is None or self.start is None:
            return None
        return self.peak - self.start


# Open trackers per device, innermost last: an inner tracker resets the device's peak, so it
# first hands the peak seen so far to the trackers around it.
_open: dict[str, list[_Tracker]] = {}


class _Tracker:
    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.result = PeakMemory(device=str(dev))
        self.seen = 0
        self.exact = True

    def current_and_peak(self) -> tuple[int | None, int | None]:
        if self.dev.type == "cuda":
            return (
                torch.cuda.memory_allocated(self.dev),
                torch.cuda.max_memory_allocated(self.dev),
            )
        proc = proc_memory()
        return proc.rss, proc.peak_rss

    def reset(self) -> bool:
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dev)
            return True
        return reset_peak_rss()


@contextmanager
def track_peak(device: DeviceLike | None = None) -> Iterator[PeakMemory]:
    """Measure the peak memory of a block; the yielded :class:`PeakMemory` fills in at its end.

    Trackers nest. On CUDA this resets the allocator's peak statistics
    (``torch.cuda.reset_peak_memory_stats``); on Linux CPUs it resets the process's peak RSS.

    >>> with track_peak("cpu") as mem:
    ...     x = torch.ones(1 << 20)
    >>> mem.peak >= mem.start
    True

    Args:
        device: the device to measure; None: ``gk.device("auto")``.
    """
    dev = _parse_device("auto" if device is None else device)
    if dev.type not in ("cuda", "cpu"):
        raise InvalidArgumentError(
            f"track_peak({str(dev)!r}) was asked for, but only CUDA and CPU peaks can be read.",
            hint='Track a "cuda" or "cpu" device.',
        )
    tracker = _Tracker(dev)
    stack = _open.setdefault(str(dev), [])
    current, peak = tracker.current_and_peak()
    for outer in stack:
        outer.seen = max(outer.seen, peak or 0)
    tracker.result.start = current
    tracker.exact = tracker.reset()
    _, hwm_at_start = tracker.current_and_peak()
    stack.append(tracker)
    try:
        yield tracker.result
    finally:
        stack.remove(tracker)
        end, peak = tracker.current_and_peak()
        tracker.result.end = end
        grew = hwm_at_start is not None and peak is not None and peak > hwm_at_start
        if peak is not None and (tracker.exact or grew):
            tracker.result.peak = max(peak, tracker.seen, end or 0)
        for outer in stack:
            outer.seen = max(outer.seen, tracker.result.peak or 0)
