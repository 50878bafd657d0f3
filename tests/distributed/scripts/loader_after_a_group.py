"""Iterate a DistributedLoader with forked workers after a process group became garbage.

A gloo group held only by a reference cycle is left uncollected when the loader starts its
workers; each worker then collects garbage while it loads, as a worker of a long run does sooner
or later. Prints the number of batches loaded.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from gpukit.distributed.data import DistributedLoader


class CollectingInWorkers(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        gc.collect()
        return torch.tensor([index])


class Holder:
    """An object in a cycle with itself: freed only by a collection."""

    def __init__(self, held: Any) -> None:
        self.held = held
        self.me = self


if __name__ == "__main__":
    store = dist.FileStore(str(Path(sys.argv[1]) / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    Holder(dist.new_group(backend="gloo"))  # a group for saves, say, in an object now garbage
    dist.destroy_process_group()
    gc.disable()  # the collection that would have freed it does not come before the workers
    data = DataLoader(CollectingInWorkers(), batch_size=2, num_workers=2, timeout=30)
    loader = DistributedLoader(
        data, batch_size=2, rank=0, world_size=1, device=torch.device("cpu"), seed=0
    )
    print(sum(1 for _ in loader))
