"""Data for several processes: a loader that shards with DistributedSampler, and knows its padding.

``DistributedSampler`` evens out a dataset whose length the world size does not divide by
repeating samples from the start of the (shuffled) order. Rank ``r`` takes positions
``r, r + W, r + 2W, ...`` of that padded order, so the repeated samples are exactly the positions
``>= len(dataset)``. :class:`DistributedLoader` counts how many samples each rank has produced,
which is all :func:`kept_mask` needs to tell, for a gathered batch, which rows are repeats.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from gpukit.errors import InvalidArgumentError
from gpukit.transfer import to_device

__all__ = ["DistributedLoader", "active_loader", "kept_mask", "per_device_size"]

_ACTIVE: list[DistributedLoader] = []


def active_loader() -> DistributedLoader | None:
    """The prepared loader whose batch is being processed now, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def kept_mask(dataset_len: int, world_size: int, start: int, batch_len: int) -> list[bool]:
    """Which rows of a gathered batch are real samples (True) rather than sampler padding.

    The gathered batch holds ``batch_len`` rows from each rank in rank order; every rank had
    produced ``start`` samples before this batch. Row ``i`` of rank ``r`` is position
    ``(start + i) * world_size + r`` of the padded order, a repeat when ``>= dataset_len``.

    >>> kept_mask(dataset_len=5, world_size=2, start=2, batch_len=1)
    [True, False]
    """
    return [
        (start + i) * world_size + r < dataset_len
        for r in range(world_size)
        for i in range(batch_len)
    ]


def per_device_size(
    world_size: int, per_device_batch_size: int | None, global_batch_size: int | None
) -> int:
    """The batch size each process loads, from exactly one of the two explicit sizes."""
    if (per_device_batch_size is None) == (global_batch_size is None):
        raise InvalidArgumentError(
            "prepare() got a loader and "
            + (
                "both per_device_batch_size and global_batch_size."
                if per_device_batch_size is not None
                else "neither per_device_batch_size nor global_batch_size."
            ),
            hint="Pass exactly one: per_device_batch_size=B (each process loads B, the step sees "
            "B x world size) or global_batch_size=G (the step sees G whatever the world size).",
        )
    for name, value in (
        ("per_device_batch_size", per_device_batch_size),
        ("global_batch_size", global_batch_size),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidArgumentError(
                f"{name}={value!r} is not a batch size.",
                hint="Pass a whole number of samples (an int).",
            )
    if global_batch_size is not None:
        if global_batch_size < 1 or global_batch_size % world_size:
            raise InvalidArgumentError(
                f"global_batch_size={global_batch_size} cannot be split evenly over "
                f"{world_size} processes.",
                hint=f"Use a positive multiple of {world_size}, or per_device_batch_size.",
            )
        return global_batch_size // world_size
    assert per_device_batch_size is not None
    if per_device_batch_size < 1:
        raise InvalidArgumentError(
            f"per_device_batch_size={per_device_batch_size} is not a batch size.",
            hint="Use a positive number of samples per process.",
        )
    return per_device_batch_size


def _shuffles(loader: DataLoader[Any]) -> bool:
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler):
        return True
    if isinstance(sampler, (SequentialSampler, DistributedSampler)):
        return bool(getattr(sampler, "shuffle", False))
    raise InvalidArgumentError(
        f"the loader samples with a {type(sampler).__name__}, which prepare() cannot shard "
        "over processes without changing what it does.",
        hint="Build the loader with shuffle=True or shuffle=False and let prepare() add a "
        "DistributedSampler, or shard your sampler yourself and skip the loader in prepare().",
    )


class DistributedLoader:
    """A DataLoader over this process's shard, with its batches moved to the process's device.

    Each pass calls ``sampler.set_epoch`` with the pass number (or the value given to
    :meth:`set_epoch`), so shuffling differs per epoch and agrees across processes.
    ``batch_size`` is per process; ``global_batch_size`` is what one step sees over all of them.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        device: torch.device,
        seed: int,
    ) -> None:
        if loader.batch_size is None:
            raise InvalidArgumentError(
                "the loader has a custom batch_sampler, so prepare() cannot set its batch size.",
                hint="Build the loader with batch_size=... and shuffle=..., not batch_sampler.",
            )
        dataset = loader.dataset
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=_shuffles(loader), seed=seed
        )
        self.loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory or device.type == "cuda",
            drop_last=loader.drop_last,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
        )
        self.dataset = dataset
        self.batch_size = batch_size
        self.global_batch_size = batch_size * world_size
        self.device = device
        self.world_size = world_size
        self._epoch = 0
        self._epoch_set = False
        self.produced = 0
        self.current_len = 0

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass's shuffle; the passes after it count on from there."""
        self._epoch = epoch
        self._epoch_set = True

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self._epoch)
        # A set_epoch before this pass is used up now; only one during it chooses the next pass.
        self._epoch_set = False
        self.produced = 0
        self.current_len = 0
        _ACTIVE.append(self)
        try:
            for batch in self.loader:
                self.produced += self.current_len
                self.current_len = _batch_len(batch)
                yield to_device(batch, self.device)
        finally:
            _ACTIVE.remove(self)
            if not self._epoch_set:
                self._epoch += 1

    def kept_rows(self) -> list[bool]:
        """For the batch being processed, which rows of a gather over all ranks are real samples."""
        if self.sampler.drop_last:
            return [True] * (self.current_len * self.world_size)
        dataset_len = len(self.dataset)  # type: ignore[arg-type]
        return kept_mask(dataset_len, self.world_size, self.produced, self.current_len)


def _batch_len(batch: Any) -> int:
    """Number of samples in a collated batch: the leading size of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        values: Any = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return 0
    for value in values:
        size = _batch_len(value)
        if size:
            return size
    return 0
