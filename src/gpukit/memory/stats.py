"""Raw memory readings: the process's resident set and a CUDA device's allocator and driver.

Each reader returns ``None`` for a figure the system cannot give, never raises for it.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_MEMINFO = Path("/proc/meminfo")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class ProcMemory:
    """This process's resident set now and at its peak, and the machine's RAM, in bytes."""

    rss: int | None
    peak_rss: int | None
    available: int | None
    total: int | None


@dataclass(frozen=True)
class CudaMemory:
    """A CUDA device's allocator figures and the driver's free and total, in bytes."""

    allocated: int | None
    reserved: int | None
    peak: int | None
    free: int | None
    total: int | None


def _kib_fields(path: Path, *keys: str) -> dict[str, int]:
    """``Key: 123 kB`` lines of a /proc file, as bytes."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in keys:
            parts = rest.split()
            if parts and parts[0].isdigit():
                found[key] = int(parts[0]) * 1024
    return found


def proc_memory() -> ProcMemory:
    """Resident set (``VmRSS``), its peak (``VmHWM``) and the RAM figures of ``/proc/meminfo``.

    Without /proc (macOS), the peak comes from ``getrusage`` and the rest is ``None``.
    """
    status = _kib_fields(_STATUS, "VmRSS", "VmHWM")
    meminfo = _kib_fields(_MEMINFO, "MemAvailable", "MemTotal")
    peak = status.get("VmHWM")
    if peak is None:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss is in kibibytes on Linux and in bytes on macOS.
        peak = maxrss if sys.platform == "darwin" else maxrss * 1024
    return ProcMemory(
        rss=status.get("VmRSS"),
        peak_rss=peak,
        available=meminfo.get("MemAvailable"),
        total=meminfo.get("MemTotal"),
    )


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS to its current RSS (Linux 4.0+); False where impossible."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def cuda_stats(dev: torch.device) -> CudaMemory:
    """``torch.cuda.memory_stats`` and ``torch.cuda.mem_get_info`` for one CUDA device."""
    stats = torch.cuda.memory_stats(dev)
    try:
        free, total = torch.cuda.mem_get_info(dev)
    except RuntimeError:  # some MIG and virtualised setups refuse the query
        free, total = None, None
    return CudaMemory(
        allocated=stats.get("allocated_bytes.all.current"),
        reserved=stats.get("reserved_bytes.all.current"),
        peak=stats.get("allocated_bytes.all.peak"),
        free=free,
        total=total,
    )
