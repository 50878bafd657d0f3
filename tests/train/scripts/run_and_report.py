"""One rank (or the only process) of the workload run, reporting each save on stdout.

    python run_and_report.py FOLDER [RANK WORLD STORE]

With RANK, WORLD and STORE it joins a gloo group through the file STORE first. After each
save it prints ``saved N`` (flushed), so that a test can kill it while it saves; at the end it
writes the final weights to FOLDER/final-RANK.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tests.train import workload


def _report(step: int) -> None:
    print(f"saved {step}", flush=True)


def main() -> None:
    folder = Path(sys.argv[1])
    rank = 0
    if len(sys.argv) > 2:
        rank, world, store = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    weights = workload.segment(str(folder / "run"), save_every=1, progress=_report)
    torch.save(torch.tensor(weights, dtype=torch.float64), folder / f"final-{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
