"""Host-to-device bandwidth: ``to_device(pin=True)`` against a raw pinned copy and a pageable one.

Runs only where a CUDA device exists. The raw pinned copy (``pinned.to("cuda",
non_blocking=True)`` on a buffer pinned once, outside the timing) is the ceiling; the pageable
copy is what ``batch.to("cuda")`` does by default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpukit.bench.core import BenchResult, compare
from gpukit.transfer import to_device

SUITE = "h2d"


def applies() -> str | None:
    """Why the suite cannot run here, or None when it can."""
    return None if torch.cuda.is_available() else "needs a CUDA device"


def run(quick: bool = False) -> list[BenchResult]:
    """GB/s of each way of copying the same host batch to cuda:0, interleaved."""
    mib = 64 if quick else 512
    n = mib * 2**20 // 4
    pageable = torch.rand(n)
    pinned = pageable.pin_memory()
    target = torch.device("cuda", 0)

    def synced(copy: object) -> None:
        torch.cuda.synchronize()

    candidates: dict[str, Callable[[], object]] = {
        "to_device(pin=True)": lambda: synced(to_device(pageable, target, pin=True)),
        "to_device(pre-pinned)": lambda: synced(to_device(pinned, target)),
        "raw pinned .to(non_blocking)": lambda: synced(pinned.to(target, non_blocking=True)),
        "pageable .to()": lambda: synced(pageable.to(target)),
    }
    times = compare(candidates, repeat=3 if quick else 9)
    gbps = {name: mib / 1024 / seconds for name, seconds in times.items()}
    raw = "raw pinned .to(non_blocking)"
    return [
        BenchResult(SUITE, f"{name}, {mib} MiB", gbps[name], "GB/s", raw, gbps[raw])
        for name in ("to_device(pin=True)", "to_device(pre-pinned)", "pageable .to()")
    ]
