"""Data for several processes: every global batch split over the ranks, no sample repeated.

One process and N processes see the same global batches: the dataset's order (shuffled with
``seed + epoch``, the same on every rank) is cut into global batches of ``global_batch_size``,
and each global batch into N contiguous shares, the first ones one sample larger when N does
not divide it. Nothing is repeated to even the ranks out (torch's ``DistributedSampler`` repeats
samples from the start of the order): the last global batch of an epoch may give a rank fewer
samples than the others, or none, and a rank with none receives an *empty batch* (the
structure of a batch, with 0 rows) so that every rank takes the same number of steps.

Because shares differ in size, averaging the ranks' gradients would weigh a sample of a small
share more than one of a large share: the gradient hook of :mod:`gpukit.distributed.weights`
weighs each rank's gradient by its share of the global batch instead, so the update is the one
a single process computes on the whole global batch.

With gradient accumulation (``accumulate=K``) a global batch is a *window* of K consecutive
micro-batches, each cut from the order and split over the ranks the same way; the last window
of an epoch holds what is left (fewer or shorter micro-batches). The loader writes where each
micro-batch sits in its window into the step's :class:`~gpukit.train.context.StepContext`, the
one object it shares with the training step (:class:`~gpukit.train.step.TrainStep`) and the
hook, which reads the step's gradient weight from it (see :mod:`gpukit.train.accumulate`).

In exact mode (an :class:`~gpukit.train.exact.ExactPlan`) a global batch is a whole step, cut
into micro-batches of the plan's fixed size, the same for any world size; each rank takes K
contiguous ones (empty past the end of a short last step). Before each micro-batch the loader
seeds the torch stream from the micro-batch's place in the epoch's order
(:mod:`gpukit.distributed.streams`), in every mode.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, SequentialSampler

from gpukit.distributed.position import checked_epoch, checked_position, checked_seed, worker_base
from gpukit.distributed.streams import seed_micro_batch
from gpukit.distributed.workers import WorkerStart
from gpukit.errors import InvalidArgumentError
from gpukit.train.context import StepContext, loader_pass
from gpukit.train.exact import ExactPlan
from gpukit.train.precision import Precision
from gpukit.train.step import TrainStep
from gpukit.transfer import to_device

__all__ = ["DistributedLoader", "RankBatches", "share"]


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
    ``seed + e``, the same on every rank and for any world size. The epoch's order is cut into
    global batches from ``cut_from`` on: 0, or the sample a resume started at (the batches
    before it may have had another size), so the rest of the epoch is cut the same way for
    any global batch size.
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
        exact: ExactPlan | None = None,
    ) -> None:
        self.dataset_len = dataset_len
        self.window = window
        self.exact = exact
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = checked_seed(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.cut_from = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` for the next pass.

        Raises:
            InvalidArgumentError: ``epoch`` is not a whole number from 0 to 2**63 - 1.
        """
        self.epoch = checked_epoch(epoch)

    def order(self) -> list[int]:
        """The dataset's order for this epoch, the same on every rank."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        gen = torch.Generator()
        gen.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=gen).tolist()

    def global_batches(self) -> list[list[int]]:
        """Every global batch of this epoch from ``start`` on (the last one shorter unless
        drop_last).

        ``start`` counts samples of the epoch's order already consumed (at least ``cut_from``,
        and on a batch's boundary after it), so the rest is cut the same for any world size.
        With a ``window`` of K micro-batches per step, drop_last drops the last incomplete
        window, so every optimizer step sees a whole global batch.
        """
        size = self.global_batch_size
        order = self.order()[self.cut_from : self.epoch_samples()]
        order = order[self.start - self.cut_from :]
        return [order[i : i + size] for i in range(0, len(order), size)]

    def __iter__(self) -> Iterator[list[int]]:
        plan = self.exact
        for batch in self.global_batches():
            if plan is None:
                yield [batch[i] for i in share(len(batch), self.world_size, self.rank)]
                continue
            # Exact mode: a global batch is a step, cut into micro-batches of the fixed size;
            # this rank takes K contiguous ones, empty past the end of a short last step.
            first = self.rank * plan.per_process
            for index in range(first, first + plan.per_process):
                start = index * plan.micro_batch_size
                yield batch[start : start + plan.micro_batch_size]

    def __len__(self) -> int:
        if self.drop_last:
            steps = self.dataset_len // (self.global_batch_size * self.window) * self.window
        else:
            full, rest = divmod(self.dataset_len, self.global_batch_size)
            steps = full + (1 if rest else 0)
        return steps * (self.exact.per_process if self.exact is not None else 1)

    def epoch_samples(self) -> int:
        """How many samples of the order one whole epoch consumes (drop_last drops the tail of
        what follows ``cut_from``: less than one whole window)."""
        if self.drop_last:
            rest = self.dataset_len - self.cut_from
            return self.dataset_len - rest % (self.global_batch_size * self.window)
        return self.dataset_len


def _batches_before(sizes: list[int], consumed: int) -> int:
    """How many of the global batches of ``sizes`` the first ``consumed`` of their samples fill.

    >>> _batches_before([4, 4, 2], 8), _batches_before([4, 4, 2], 0)
    (2, 0)
    """
    total = 0
    for index, size in enumerate(sizes):
        if total >= consumed:
            return index
        total += size
    return len(sizes)


class _EmptyAware:
    """The loader's collate function, which also builds the batch of an empty share.

    A batch of no sample has no structure to collate from, so one sample is collated and
    every tensor (and list) in it cut to 0 rows: the model runs on it, its gradient is 0. With
    ``stand_in`` the sample stays whole instead, for models that cannot run on 0 rows (a
    Hugging Face model's attention reshapes with ``-1``): the step weighs it 0.
    """

    def __init__(
        self, collate: Callable[[list[Any]], Any], dataset: Sequence[Any], stand_in: bool
    ) -> None:
        self.collate = collate
        self.dataset = dataset
        self.stand_in = stand_in

    def __call__(self, samples: list[Any]) -> Any:
        if samples:
            return self.collate(samples)
        batch = self.collate([self.dataset[0]])
        return batch if self.stand_in else _empty(batch)


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


def _forks_workers(loader: DataLoader[Any]) -> bool:
    """Whether iterating ``loader`` now starts worker processes by forking this one."""
    if loader.num_workers == 0:
        return False
    if loader.persistent_workers and getattr(loader, "_iterator", None) is not None:
        return False  # its workers are already running
    context = loader.multiprocessing_context
    method = context.get_start_method() if context is not None else mp.get_start_method()
    return method == "fork"


class DistributedLoader:
    """A DataLoader over this process's share of each global batch, moved to its device.

    Each pass calls ``set_epoch`` on the sampler with the pass number (or the value given to
    :meth:`set_epoch`), so shuffling differs per epoch and agrees across processes. Every rank
    yields ``len(self)`` batches; the last may be shorter, or empty on some ranks. A pass left
    before its last batch (``break``) keeps its place: the next pass continues that epoch, so
    a state saved after the loop has left it resumes where the loop stopped.
    ``batch_size`` is per process and micro-batch; ``global_batch_size`` is what one optimizer
    step sees over all processes and its ``accumulate`` micro-batches.

    Before each micro-batch the loader writes its place into :attr:`context`, the
    :class:`~gpukit.train.context.StepContext` it shares with ``train_step`` (given, or the
    one ``context`` belongs to) and the gradient hook; without either it makes its own.

    Args:
        loader: the DataLoader to shard: its dataset, shuffle, collate and worker settings.
        batch_size: the samples each process loads per micro-batch, 1 or more.
        rank: this process's rank, 0 to ``world_size - 1``.
        world_size: how many processes share each global batch.
        device: where the batches are moved.
        seed: the shuffle's seed (the same on every rank).
        accumulate: micro-batches per optimizer step, 1 or more.
        train_step: the training step whose context the loader fills, or None.
        context: the step context to fill; None: ``train_step``'s, or a new one.
        exact: exact mode's cut (:func:`~gpukit.train.exact.exact_plan`), which then decides
            ``batch_size`` and ``accumulate``; None: the cut above.
        stand_in: an empty share arrives as a stand-in, the dataset's first sample, weighed
            0 by the step (:attr:`current_len` is 0 there), instead of a batch of 0 rows.

    Raises:
        InvalidArgumentError: the loader has a custom batch sampler or sampler, ``seed`` is
            not a whole number from 0 to 2**63 - 1, ``context`` and ``train_step`` (or
            ``accumulate``) do not belong together, or the dataset follows the epoch
            (``set_epoch``) under persistent workers.
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
        context: StepContext | None = None,
        exact: ExactPlan | None = None,
        stand_in: bool = False,
    ) -> None:
        if exact is not None:  # the plan decides the cut: K micro-batches of m per process
            batch_size, accumulate = exact.micro_batch_size, exact.per_process
        self.context = _loader_context(accumulate, train_step, context)
        if loader.batch_size is None:
            raise InvalidArgumentError(
                "the loader has a custom batch_sampler, so prepare() cannot set its batch size.",
                hint="Build the loader with batch_size=... and shuffle=..., not batch_sampler.",
            )
        dataset = loader.dataset
        _check_epoch_aware(loader)
        self.sampler = RankBatches(
            len(dataset),  # type: ignore[arg-type]
            global_batch_size=exact.global_batch_size
            if exact is not None
            else batch_size * world_size,
            rank=rank,
            world_size=world_size,
            shuffle=_shuffles(loader),
            seed=seed,
            drop_last=loader.drop_last,
            window=1 if exact is not None else accumulate,
            exact=exact,
        )
        self.exact = exact
        # The workers' base seed comes from this generator, reseeded each pass from (seed, epoch,
        # rank): a pass then draws nothing from the process's own torch stream, and a pass
        # resumed mid-epoch gives its workers the seeds the uninterrupted pass gave them.
        self._worker_seeds = torch.Generator()
        self.loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_sampler=self.sampler,
            generator=self._worker_seeds,
            num_workers=loader.num_workers,
            collate_fn=_EmptyAware(loader.collate_fn, dataset, stand_in),  # type: ignore[arg-type]
            pin_memory=loader.pin_memory or device.type == "cuda",
            timeout=loader.timeout,
            worker_init_fn=WorkerStart(loader.worker_init_fn),
            multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
        )
        self.dataset = dataset
        self.stand_in = stand_in  # empty shares arrive as stand-ins (current_len 0)
        self.batch_size = batch_size
        self.accumulate = accumulate
        self.global_batch_size = batch_size * world_size * accumulate
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self._epoch = 0  # the epoch of the pass in progress, or else of the next pass
        self._consumed = 0  # samples of that epoch's order consumed (see state_dict)
        self._in_pass = False
        self._next_epoch: int | None = None  # chosen by set_epoch during a pass

    @property
    def train_step(self) -> TrainStep | None:
        """The training step this loader places micro-batches for (``dist.step`` calls it)."""
        step: TrainStep | None = self.context.train_step
        return step

    @property
    def precision(self) -> Precision | None:
        """The precision ``prepare()`` resolved (``.name``: what ``"auto"`` chose); None for a
        loader made without ``prepare()`` or a training step."""
        return self.context.precision

    @property
    def current_len(self) -> int:
        """This rank's samples in the batch being processed (0 before the first)."""
        return self.context.samples or 0

    @property
    def current_global_len(self) -> int:
        """The samples of the batch being processed over every rank (0 before the first)."""
        return self.context.global_samples or 0

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass's shuffle; the passes after it count on from there.

        Setting the epoch the loader is already in keeps its position inside that epoch (after
        :meth:`load_state_dict`, or a pass left early); another epoch starts at its beginning.

        Args:
            epoch: the epoch of the next pass, 0 to 2**63 - 1.

        Raises:
            InvalidArgumentError: ``epoch`` is not a whole number from 0 to 2**63 - 1; the
                loader's position is left as it was.
        """
        epoch = checked_epoch(epoch)
        if self._in_pass:
            self._next_epoch = epoch  # chooses the next pass; this one keeps its position
            return
        if epoch != self._epoch:
            self._start_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    def state_dict(self) -> dict[str, int]:
        """Where the next batch comes from: the epoch and the samples of its order consumed.

        The position counts samples of the epoch's global order (the same for any world size),
        so the state resumes on another number of processes: the rest of the epoch is dealt
        out again, no sample repeated or skipped. A batch counts as consumed once it has been
        handed out, so save after the step that used it.
        """
        epoch, consumed = self._epoch, self._consumed
        if consumed >= self.sampler.epoch_samples():
            epoch, consumed = epoch + 1, 0  # the epoch's last batch is out: the next one is next
        return {
            "epoch": epoch,
            "consumed": consumed,
            "seed": self.sampler.seed,
            "shuffle": int(self.sampler.shuffle),
            "dataset_len": self.sampler.dataset_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next pass starts where that one stopped.

        Index arithmetic, not replay: resuming at batch 10,000 costs what batch 10 costs.

        Args:
            state: what :meth:`state_dict` returned, read from a save.

        Raises:
            InvalidArgumentError: the state is not a loader's (a field that is not a whole
                number, an epoch or seed above 2**63 - 1, more samples consumed than the
                dataset holds), or it describes another dataset length, seed or shuffle than
                this loader's; the loader's position is left as it was.
        """
        checked_position(
            state,
            seed=self.sampler.seed,
            shuffle=self.sampler.shuffle,
            dataset_len=self.sampler.dataset_len,
        )  # checked before anything changes
        # The saved run may have cut its batches at another size (another number of processes
        # under per_device_batch_size): the rest of the epoch is cut from the saved position.
        self._epoch = int(state["epoch"])
        self._consumed = self.sampler.cut_from = int(state["consumed"])

    def _start_epoch(self, epoch: int) -> None:
        """Place the loader at the start of ``epoch``, cut into batches from its first sample."""
        self._epoch, self._consumed = epoch, 0
        self.sampler.cut_from = 0

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        epoch = self._epoch
        self.sampler.set_epoch(epoch)
        # Every global batch's size from where the epoch's cut begins (its start, or the sample
        # a resume started at), and how many of them were consumed before this pass (a pass left
        # early): index arithmetic, no replay. The optimizer steps' windows count from there.
        cut_from = self.sampler.cut_from
        self.sampler.start = cut_from
        sizes = [len(b) for b in self.sampler.global_batches()]
        before = _batches_before(sizes, self._consumed - cut_from)
        self.sampler.start = self._consumed  # mid-epoch: only the rest of the epoch's order
        if callable(set_epoch := getattr(self.dataset, "set_epoch", None)):
            set_epoch(epoch)  # per-sample streams (sample_generator) follow the epoch
        self._worker_seeds.manual_seed(worker_base(self.sampler.seed, epoch, self.rank))
        self._in_pass, self._next_epoch = True, None
        self.context.samples = self.context.global_samples = 0
        ended = False
        if _forks_workers(self.loader):
            # A worker forked now would inherit this process's uncollected garbage, and a
            # collection in it would destroy a C++ object of this process (a process group
            # left in a reference cycle) whose threads the worker does not have: the worker
            # hangs or aborts. Collected here, where those threads run.
            gc.collect()
        try:
            with loader_pass(self.context):
                for step, batch in enumerate(self.loader):
                    position = self._place(before, step, sizes)
                    seed_micro_batch(self.device, self.sampler.seed, epoch, position)
                    yield to_device(batch, self.device)
            ended = True
        finally:
            self.sampler.start = 0
            self._in_pass = False
            if (chosen := self._chosen_next()) is not None:
                self._start_epoch(chosen)
            elif ended or self._consumed >= self.sampler.epoch_samples():
                self._start_epoch(epoch + 1)
            # else a pass left early (break): it keeps its place, the next pass continues it

    def _chosen_next(self) -> int | None:
        """The epoch a set_epoch during the pass chose for the next pass, if any."""
        return self._next_epoch

    def _place(self, before: int, handed: int, sizes: list[int]) -> int:
        """Write where the pass's micro-batch ``handed`` sits in its optimizer step into the
        context, count its samples as consumed once its step's last is out, and return where
        this rank's samples of it start in the epoch's order (its random stream's key).

        ``sizes`` are the global batches' sizes from the epoch's cut on, ``before`` of them
        consumed before the pass.
        """
        plan = self.exact
        if plan is None:
            step = before + handed
            start = step - step % self.accumulate
            window = sizes[start : start + self.accumulate]
            mine = share(sizes[step], self.world_size, self.rank)
            self.context.place(step - start, len(window), len(mine), sum(window), sizes[step])
            position = self._consumed + mine.start
            self._consumed += sizes[step]
            return position
        step, k = before + handed // plan.per_process, handed % plan.per_process
        samples = sizes[step]
        index = self.rank * plan.per_process + k  # the micro-batch's index in its step
        beside = range(k, plan.micro_batches, plan.per_process)  # every rank's k-th, at once
        self.context.place(
            k,
            plan.per_process,
            plan.samples_of(samples, index),
            samples,
            sum(plan.samples_of(samples, i) for i in beside),
        )
        position = self._consumed + index * plan.micro_batch_size
        if k == plan.per_process - 1:
            self._consumed += samples
        return position

    def kept_rows(self) -> list[bool]:
        """For the batch being processed, which rows of a gather over all ranks are samples.

        Every row is: no sample is repeated, so a gather holds the global batch exactly once.
        """
        return [True] * self.current_global_len


def _check_epoch_aware(loader: DataLoader[Any]) -> None:
    """Refuse a dataset that follows the epoch (``set_epoch``) under persistent workers.

    Persistent workers keep the copy of the dataset they started with: the epoch set before a
    later pass would never reach them, and their per-sample draws would repeat epoch 0's.

    Raises:
        InvalidArgumentError: the dataset has ``set_epoch`` and the loader persistent workers.
    """
    if loader.persistent_workers and callable(getattr(loader.dataset, "set_epoch", None)):
        raise InvalidArgumentError(
            f"the dataset ({type(loader.dataset).__name__}) follows the epoch with set_epoch, "
            "and the loader keeps persistent workers, whose copies of the dataset never see a "
            "later epoch.",
            hint="Build the loader with persistent_workers=False.",
        )


def _loader_context(
    accumulate: int, train_step: TrainStep | None, context: StepContext | None
) -> StepContext:
    """The step context a loader fills: the one given, the training step's, or a new one.

    Raises:
        InvalidArgumentError: the training step reads another context, or the context counts
            another number of micro-batches per step than the loader's ``accumulate``.
    """
    if context is None:
        context = train_step.context if train_step is not None else StepContext(accumulate)
    if train_step is not None and train_step.context is not context:
        raise InvalidArgumentError(
            "the loader got a train_step that reads another step context than its own.",
            hint="Pass the step's own: context=train_step.context (or only train_step).",
        )
    if context.accumulate != accumulate:
        raise InvalidArgumentError(
            f"the loader cuts accumulate={accumulate} micro-batches per step, and its step "
            f"context counts {context.accumulate}.",
            hint="Give the loader, its step context and its training step one accumulate=.",
        )
    return context
