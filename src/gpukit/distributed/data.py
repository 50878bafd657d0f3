"""Data for several processes: every global batch split over the ranks, no sample repeated.

One process and N processes see the same global batches: the dataset's order (shuffled with
``seed + epoch``, the same on every rank) is cut into global batches of ``global_batch_size``,
and each global batch into N contiguous shares, the first ones one sample larger when N does
not divide it. Nothing is repeated to even the ranks out (torch's ``DistributedSampler`` repeats
samples from the start of the order): the last global batch of an epoch may give a rank fewer
samples than the others, or none, and a rank with none receives an *empty batch* (the
structure of a batch, with 0 rows) so that every rank takes the same number of steps.

Because shares differ in size, averaging the ranks' gradients would weigh a sample of a small
share more than one of a large share. :class:`SampleWeights` (a DDP communication hook that
:func:`~gpukit.distributed.ddp.prepare` installs) weighs each rank's gradient by its
share of the global batch instead, so the update is the one a single process computes on the
whole global batch.

With gradient accumulation (``accumulate=K``) a global batch is a *window* of K consecutive
micro-batches, each cut from the order and split over the ranks the same way; the last window
of an epoch holds what is left (fewer or shorter micro-batches). The loader tells the training
step (:class:`~gpukit.train.step.TrainStep`) where each micro-batch sits in its window, and the
hook then applies the step's gradient weight (see :mod:`gpukit.train.accumulate`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    GradBucket,  # public as torch.distributed.GradBucket; typed here
)
from torch.utils.data import DataLoader, RandomSampler, Sampler, SequentialSampler

from gpukit.errors import InvalidArgumentError
from gpukit.train.step import TrainStep, done_feeding, feeding
from gpukit.transfer import to_device

__all__ = [
    "DistributedLoader",
    "RankBatches",
    "SampleWeights",
    "active_loader",
    "micro_batches",
    "per_device_size",
    "share",
    "weighted_allreduce",
]

_ACTIVE: list[DistributedLoader] = []


def active_loader() -> DistributedLoader | None:
    """The prepared loader whose batch is being processed now, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def share(batch_len: int, world_size: int, rank: int) -> range:
    """The positions of a global batch of ``batch_len`` samples that ``rank`` takes.

    Contiguous shares in rank order, the first ``batch_len % world_size`` one larger, so a
    gather in rank order gives back the global batch in its order.

    >>> [list(share(5, 2, r)) for r in range(2)], list(share(1, 2, 1))
    ([[0, 1, 2], [3, 4]], [])
    """
    base, extra = divmod(batch_len, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


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


def micro_batches(
    world_size: int,
    per_device_batch_size: int | None,
    global_batch_size: int | None,
    accumulate: int | None,
) -> tuple[int, int]:
    """Each process's micro-batch size and the micro-batches per optimizer step (K).

    Two of the three sizes decide the third: ``global_batch_size = per_device_batch_size x
    world_size x K``. With one batch size alone and no ``accumulate``, K is 1.
    """
    if accumulate is not None and (
        isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1
    ):
        raise InvalidArgumentError(
            f"accumulate={accumulate!r} is not a number of micro-batches per optimizer step.",
            hint="Pass a whole number, 1 or more (1: no accumulation).",
        )
    if per_device_batch_size is None or global_batch_size is None:
        steps = accumulate or 1
        if global_batch_size is None:
            return per_device_size(world_size, per_device_batch_size, None), steps
        per_device_size(world_size, None, global_batch_size)  # its type, sign and split
        if global_batch_size % (world_size * steps):
            raise InvalidArgumentError(
                f"global_batch_size={global_batch_size} cannot be cut into {steps} "
                f"micro-batches on each of {world_size} processes.",
                hint=f"Use a multiple of {world_size * steps}, or another accumulate=.",
            )
        return global_batch_size // (world_size * steps), steps
    size = per_device_size(world_size, per_device_batch_size, None)
    per_step = size * world_size
    per_device_size(world_size, None, global_batch_size)  # the same checks on the global size
    if global_batch_size % per_step or (accumulate and accumulate * per_step != global_batch_size):
        raise InvalidArgumentError(
            f"global_batch_size={global_batch_size} is not per_device_batch_size={size} x "
            f"{world_size} processes x "
            + (f"accumulate={accumulate}." if accumulate else "a whole number of micro-batches."),
            hint="Give two of the three sizes and let prepare() derive the third, or pick "
            f"a global batch that is a multiple of {per_step}.",
        )
    return size, global_batch_size // per_step


def _shuffles(loader: DataLoader[Any]) -> bool:
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler):
        return True
    if isinstance(sampler, SequentialSampler):
        return False
    raise InvalidArgumentError(
        f"the loader samples with a {type(sampler).__name__}, which prepare() cannot shard "
        "over processes without changing what it does.",
        hint="Build the loader with shuffle=True or shuffle=False and let prepare() shard it, "
        "or shard your sampler yourself and skip the loader in prepare().",
    )


class RankBatches(Sampler[list[int]]):
    """This rank's share of each global batch, as lists of dataset indices (maybe empty).

    ``set_epoch(e)`` chooses the shuffle: the order is ``torch.randperm`` seeded with
    ``seed + e``, the same on every rank and for any world size.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        global_batch_size: int,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        window: int = 1,
    ) -> None:
        self.dataset_len = dataset_len
        self.window = window
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` for the next pass."""
        self.epoch = epoch

    def order(self) -> list[int]:
        """The dataset's order for this epoch, the same on every rank."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        gen = torch.Generator()
        gen.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=gen).tolist()

    def global_batches(self) -> list[list[int]]:
        """Every global batch of this epoch (the last one shorter unless drop_last).

        With a ``window`` of K micro-batches per step, drop_last drops the last incomplete
        window, so every optimizer step sees a whole global batch.
        """
        order, size = self.order(), self.global_batch_size
        if self.drop_last:
            whole = size * self.window
            order = order[: len(order) // whole * whole]
        return [order[i : i + size] for i in range(0, len(order), size)]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches():
            yield [batch[i] for i in share(len(batch), self.world_size, self.rank)]

    def __len__(self) -> int:
        if self.drop_last:
            return self.dataset_len // (self.global_batch_size * self.window) * self.window
        full, rest = divmod(self.dataset_len, self.global_batch_size)
        return full + (1 if rest else 0)


class _EmptyAware:
    """The loader's collate function, which also builds a 0-row batch for an empty share.

    A batch of no sample has no structure to collate from, so one sample is collated and
    every tensor (and list) in it cut to 0 rows: the model runs on it, its gradient is 0.
    """

    def __init__(self, collate: Callable[[list[Any]], Any], dataset: Sequence[Any]) -> None:
        self.collate = collate
        self.dataset = dataset

    def __call__(self, samples: list[Any]) -> Any:
        if samples:
            return self.collate(samples)
        return _empty(self.collate([self.dataset[0]]))


def _empty(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:0] if batch.dim() else batch
    if isinstance(batch, dict):
        return type(batch)({k: _empty(v) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_empty(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        if batch and all(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in batch):
            return type(batch)(_empty(v) for v in batch)
        return type(batch)()  # a list of per-sample values (strings, ids): no sample, no value
    return batch


class SampleWeights:
    """State of the DDP communication hook that weighs each rank's gradient by its samples.

    Each rank's gradient is the mean over its own share of ``n_r`` samples; the hook sums
    ``n_r / n * grad_r`` over the ranks, where ``n`` is the global batch's size, which is the
    mean over the whole global batch: exactly one process's gradient. Outside a prepared
    loader's batch (or with equal shares) it is DDP's plain average. The loss must be a mean
    over the batch (PyTorch's default ``reduction="mean"``).
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def weight(self) -> float:
        """This rank's share of the current global batch, or 1/N outside a prepared loader."""
        loader = active_loader()
        if loader is None:
            return 1.0 / self.world_size
        step = loader.train_step
        if step is not None and step.accumulation.global_total is not None:
            return step.accumulation.gradient_weight()  # the step's micro-batches, weighed
        if loader.current_global_len == 0:
            return 1.0 / self.world_size
        return loader.current_len / loader.current_global_len


def weighted_allreduce(
    state: SampleWeights, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The communication hook of :class:`SampleWeights`: register it with that state."""
    buffer = bucket.buffer()
    weight = state.weight()
    if weight == 0.0:
        buffer.zero_()  # an empty share: a loss over no sample may read nan, its gradient is 0
    else:
        buffer.mul_(weight)
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True)
    assert work is not None
    summed: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    return summed


# DDP checks the hook's annotations as objects; this module's are strings (future annotations).
weighted_allreduce.__annotations__ = {
    "state": SampleWeights,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


class DistributedLoader:
    """A DataLoader over this process's share of each global batch, moved to its device.

    Each pass calls ``set_epoch`` on the sampler with the pass number (or the value given to
    :meth:`set_epoch`), so shuffling differs per epoch and agrees across processes. Every rank
    yields ``len(self)`` batches; the last may be shorter, or empty on some ranks.
    ``batch_size`` is per process and micro-batch; ``global_batch_size`` is what one optimizer
    step sees over all processes and its ``accumulate`` micro-batches.
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
        accumulate: int = 1,
        train_step: TrainStep | None = None,
    ) -> None:
        if loader.batch_size is None:
            raise InvalidArgumentError(
                "the loader has a custom batch_sampler, so prepare() cannot set its batch size.",
                hint="Build the loader with batch_size=... and shuffle=..., not batch_sampler.",
            )
        dataset = loader.dataset
        self.sampler = RankBatches(
            len(dataset),  # type: ignore[arg-type]
            global_batch_size=batch_size * world_size,
            rank=rank,
            world_size=world_size,
            shuffle=_shuffles(loader),
            seed=seed,
            drop_last=loader.drop_last,
            window=accumulate,
        )
        self.loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_sampler=self.sampler,
            num_workers=loader.num_workers,
            collate_fn=_EmptyAware(loader.collate_fn, dataset),  # type: ignore[arg-type]
            pin_memory=loader.pin_memory or device.type == "cuda",
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
        )
        self.dataset = dataset
        self.batch_size = batch_size
        self.accumulate = accumulate
        self.global_batch_size = batch_size * world_size * accumulate
        self.train_step = train_step
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self._epoch = 0
        self._epoch_set = False
        self.current_len = 0
        self.current_global_len = 0

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass's shuffle; the passes after it count on from there."""
        self._epoch = epoch
        self._epoch_set = True

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self._epoch)
        sizes = [len(b) for b in self.sampler.global_batches()]
        # A set_epoch before this pass is used up now; only one during it chooses the next pass.
        self._epoch_set = False
        self.current_len = 0
        self.current_global_len = 0
        _ACTIVE.append(self)
        if self.train_step is not None:
            feeding(self.train_step)
        try:
            for step, batch in enumerate(self.loader):
                self.current_global_len = sizes[step]
                self.current_len = len(share(sizes[step], self.world_size, self.rank))
                if self.train_step is not None:
                    self._place(step, sizes)
                yield to_device(batch, self.device)
        finally:
            _ACTIVE.remove(self)
            if self.train_step is not None:
                done_feeding(self.train_step)
            if not self._epoch_set:
                self._epoch += 1

    def _place(self, step: int, sizes: list[int]) -> None:
        """Tell the training step where micro-batch ``step`` sits in its optimizer step."""
        assert self.train_step is not None
        start = step - step % self.accumulate
        window = sizes[start : start + self.accumulate]
        self.train_step.begin(step - start, len(window), self.current_len, sum(window))

    def kept_rows(self) -> list[bool]:
        """For the batch being processed, which rows of a gather over all ranks are samples.

        Every row is: no sample is repeated, so a gather holds the global batch exactly once.
        """
        return [True] * self.current_global_len
