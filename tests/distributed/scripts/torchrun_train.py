"""A training script as users write it, started by torchrun; writes its rank's result as JSON."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path

import workloads
from torch import nn

from gpukit import distributed as dist


def _live_threads() -> list[str]:
    """The names of this process's threads that have not finished exiting."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except FileNotFoundError:  # it ended while we looked
            continue
        if stat.rpartition(")")[2].split()[0] not in ("Z", "X"):
            names.append(name)
    return names


def _threads_at_exit(out: Path) -> None:
    """Write the names of this process's threads; registered before init(), it runs after.

    A joined thread stays listed in /proc for a moment after ``pthread_join`` returns (the
    kernel wakes the joiner before it reaps the task), longer on a loaded machine: wait a little
    for the group's threads to leave, so that only one still running is reported.
    """
    deadline = time.monotonic() + 5
    names = _live_threads()
    while any("gloo" in name for name in names) and time.monotonic() < deadline:
        time.sleep(0.05)
        names = _live_threads()
    Path(out, f"{os.getpid()}.threads").write_text(json.dumps(names))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    Path(out, f"{os.getpid()}.pid").write_text(str(os.getpid()))
    atexit.register(_threads_at_exit, out)
    ctx = dist.init()
    weights = workloads.train()
    kept = dist.prepare(nn.Linear(2, 2))  # a model the script holds until it exits
    dist.barrier()
    result = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "weights": weights,
    }
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(result))
