"""One rank of an exact-mode run that saves every step and reports each save on stdout.

    python same_bits_killed.py FOLDER RANK WORLD STORE

It joins a gloo group through the file STORE, resumes from FOLDER's newest complete save and
trains; after each save it prints ``saved N`` (flushed), so that a test can kill it with
SIGKILL while the save is being written.
"""

from __future__ import annotations

import sys

import same_bits as work
import torch
import torch.distributed as dist


def main() -> None:
    folder, rank, world, store = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    work.segment(
        work.Case(),
        folder,
        None,
        save_every=1,
        progress=lambda step: print(f"saved {step}", flush=True),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
