"""The prepared loader's rules: the batch sizes it takes, what it keeps of the user's DataLoader,
the empty batch of a rank with no sample, and how uneven shares weigh in the gradient.

The tests at the end run in a real two-process gloo group whose rank 0 is this process (see
``two_processes``): the gradient hook and the gather of a step need the other rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
    default_collate,
    get_worker_info,
)

from gpukit import distributed as dist
from gpukit.distributed.batch_sizes import per_device_size
from gpukit.distributed.data import DistributedLoader, RankBatches
from gpukit.distributed.weights import SampleWeights, weighted_allreduce
from gpukit.errors import InvalidArgumentError
from tests.helpers import subprocess_env
from tests.helpers.two_processes import OtherRank, two_processes

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def _ids(n: int, **options: Any) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.arange(n)), **{"batch_size": 4, **options})


def _refusal(call: Callable[[], object]) -> tuple[str, str | None]:
    with pytest.raises(InvalidArgumentError) as caught:
        call()
    return caught.value.message, caught.value.hint


# -- the batch sizes prepare() takes -------------------------------------------------------------

EXACTLY_ONE = (
    "Pass exactly one: per_device_batch_size=B (each process loads B, the step sees B x world "
    "size) or global_batch_size=G (the step sees G whatever the world size)."
)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({}, "prepare() got a loader and neither per_device_batch_size nor global_batch_size."),
    ],
    ids=["neither"],  # both together are a micro-batch and its global batch (accumulation)
)
def test_a_loader_needs_exactly_one_batch_size_and_the_error_explains_both(
    sizes: dict[str, int], message: str
) -> None:
    refusal = _refusal(lambda: dist.prepare(nn.Linear(1, 1), loader=_ids(8), **sizes))
    assert refusal == (message, EXACTLY_ONE)


@pytest.mark.parametrize(
    ("per_device", "global_", "message"),
    [
        (3.5, None, "per_device_batch_size=3.5 is not a batch size."),
        (True, None, "per_device_batch_size=True is not a batch size."),
        (None, 8.0, "global_batch_size=8.0 is not a batch size."),
    ],
)
def test_a_batch_size_that_is_not_an_int_is_refused_by_name(
    per_device: object, global_: object, message: str
) -> None:
    refusal = _refusal(lambda: per_device_size(2, per_device, global_))  # type: ignore[arg-type]
    assert refusal == (message, "Pass a whole number of samples (an int).")


@pytest.mark.parametrize("global_", [30, 0, -4])
def test_a_global_batch_size_that_is_no_positive_multiple_of_the_world_is_refused(
    global_: int,
) -> None:
    assert _refusal(lambda: per_device_size(4, None, global_)) == (
        f"global_batch_size={global_} cannot be split evenly over 4 processes.",
        "Use a positive multiple of 4, or per_device_batch_size.",
    )


@pytest.mark.parametrize("per_device", [0, -1])
def test_a_per_device_batch_size_below_1_is_refused(per_device: int) -> None:
    assert _refusal(lambda: per_device_size(4, per_device, None)) == (
        f"per_device_batch_size={per_device} is not a batch size.",
        "Use a positive number of samples per process.",
    )


def test_batches_of_a_single_sample_are_accepted_either_way() -> None:
    assert per_device_size(1, 1, None) == 1
    assert per_device_size(1, None, 1) == 1
    assert per_device_size(3, None, 3) == 1


def test_a_global_batch_size_in_one_process_loads_whole_global_batches() -> None:
    _, loader = dist.prepare(nn.Linear(1, 1), loader=_ids(10, batch_size=3), global_batch_size=4)
    assert [batch[0].tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert (loader.batch_size, loader.global_batch_size) == (4, 4)


def test_the_loader_reports_its_dataset_and_both_batch_sizes() -> None:
    data = TensorDataset(torch.arange(20))
    loader = DistributedLoader(
        DataLoader(data, batch_size=5), batch_size=2, rank=1, world_size=3, device=CPU, seed=0
    )
    assert loader.dataset is data
    assert (loader.batch_size, loader.global_batch_size) == (2, 6)
    assert len(loader) == 4  # 6 + 6 + 6 + 2


# -- loaders prepare() cannot shard ----------------------------------------------------------------


def test_a_sampler_prepare_cannot_shard_is_refused_saying_what_to_build_instead() -> None:
    data = TensorDataset(torch.arange(8))
    weighted = DataLoader(data, batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8))
    refusal = _refusal(
        lambda: dist.prepare(nn.Linear(1, 1), loader=weighted, per_device_batch_size=2)
    )
    assert refusal == (
        "the loader samples with a WeightedRandomSampler, which prepare() cannot shard over "
        "processes without changing what it does.",
        "Build the loader with shuffle=True or shuffle=False and let prepare() shard it, or "
        "shard your sampler yourself and skip the loader in prepare().",
    )


def test_a_loader_with_its_own_batch_sampler_is_refused_saying_how_to_build_it() -> None:
    data = TensorDataset(torch.arange(8))
    batches = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 2, False))
    refusal = _refusal(
        lambda: dist.prepare(nn.Linear(1, 1), loader=batches, per_device_batch_size=2)
    )
    assert refusal == (
        "the loader has a custom batch_sampler, so prepare() cannot set its batch size.",
        "Build the loader with batch_size=... and shuffle=..., not batch_sampler.",
    )


def test_a_sampler_not_yet_given_an_epoch_shuffles_as_epoch_0() -> None:
    sampler = RankBatches(
        8, global_batch_size=8, rank=0, world_size=1, shuffle=True, seed=3, drop_last=False
    )
    # torch's DistributedSampler rule: the order of epoch e is randperm seeded with seed + e.
    assert list(sampler) == [torch.randperm(8, generator=torch.Generator().manual_seed(3)).tolist()]


# -- what the prepared loader keeps of the user's DataLoader ------------------------------------


def _init_worker(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    info.dataset.offset = 100  # type: ignore[attr-defined]


def test_the_prepared_loader_loads_with_the_users_worker_and_memory_settings() -> None:
    data = _ids(
        8,
        batch_size=2,
        num_workers=2,
        timeout=30,
        worker_init_fn=_init_worker,
        multiprocessing_context="fork",
        prefetch_factor=3,
        persistent_workers=True,
        pin_memory=True,
    )
    loader = DistributedLoader(data, batch_size=2, rank=0, world_size=1, device=CPU, seed=0)
    # `loader.loader` is the DataLoader that yields the batches.
    inner = loader.loader
    assert (
        inner.num_workers,
        inner.timeout,
        inner.worker_init_fn,
        inner.multiprocessing_context,
        inner.prefetch_factor,
        inner.persistent_workers,
        inner.pin_memory,
    ) == (2, 30, inner.worker_init_fn, data.multiprocessing_context, 3, True, True)
    assert inner.worker_init_fn.user is _init_worker  # type: ignore[union-attr]


def test_a_loader_for_a_cuda_device_pins_host_memory_and_one_for_the_cpu_does_not() -> None:
    def pins(device: str) -> bool:
        return DistributedLoader(
            _ids(8), batch_size=2, rank=0, world_size=1, device=torch.device(device), seed=0
        ).loader.pin_memory

    assert (pins("cuda:0"), pins("cpu")) == (True, False)


class WorkerIds(Dataset[torch.Tensor]):
    """Each sample says which process loaded it, and what its worker_init_fn set up."""

    offset = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([os.getpid(), self.offset])


def test_batches_come_from_the_users_persistent_workers_set_up_by_its_worker_init_fn() -> None:
    data = DataLoader(
        WorkerIds(),
        batch_size=2,
        num_workers=1,
        worker_init_fn=_init_worker,
        persistent_workers=True,
    )
    loader = DistributedLoader(data, batch_size=4, rank=0, world_size=1, device=CPU, seed=0)
    loaded = [batch for _ in range(2) for batch in loader]  # two passes
    pids = {pid for batch in loaded for pid in batch[:, 0].tolist()}
    assert len(pids) == 1  # one worker served both passes
    assert pids != {os.getpid()}
    assert {offset for batch in loaded for offset in batch[:, 1].tolist()} == {100}


# -- the empty batch of a rank with no sample ----------------------------------------------------


def _batches_of_rank_1(dataset: Any, collate_fn: Any = None) -> list[Any]:
    """Rank 1's batches when two ranks share batches of 2: with 1 sample, rank 1 gets none."""
    data = DataLoader(dataset, batch_size=1, collate_fn=collate_fn)
    return list(DistributedLoader(data, batch_size=1, rank=1, world_size=2, device=CPU, seed=0))


def test_the_empty_batch_of_a_one_sample_dataset_is_built_from_that_sample() -> None:
    (batch,) = _batches_of_rank_1(TensorDataset(torch.ones(1, 3)))
    assert batch[0].shape == (0, 3)


def test_an_empty_batch_of_dicts_keeps_the_keys_with_no_rows() -> None:
    (batch,) = _batches_of_rank_1([{"x": torch.ones(2), "label": 7}])
    assert type(batch) is dict
    assert {key: value.shape for key, value in batch.items()} == {"x": (0, 2), "label": (0,)}


class Sample(NamedTuple):
    x: torch.Tensor
    label: int


def test_an_empty_batch_of_named_tuples_is_that_named_tuple_with_no_rows() -> None:
    (batch,) = _batches_of_rank_1([Sample(torch.ones(2), 7)])
    assert type(batch) is Sample
    assert (batch.x.shape, batch.label.shape) == ((0, 2), (0,))


def test_an_empty_batch_a_collate_fn_makes_a_tuple_stays_a_tuple() -> None:
    def as_tuple(samples: list[Any]) -> tuple[Any, ...]:
        return tuple(default_collate(samples))

    (batch,) = _batches_of_rank_1(TensorDataset(torch.ones(1, 2), torch.zeros(1)), as_tuple)
    assert type(batch) is tuple
    assert [part.shape for part in batch] == [(0, 2), (0,)]


def test_per_sample_strings_in_an_empty_batch_are_an_empty_collection() -> None:
    (batch,) = _batches_of_rank_1([(torch.ones(2), "cat.jpg")])
    assert batch[0].shape == (0, 2)
    assert batch[1] == ()  # default_collate gathers strings in a tuple


def test_a_per_batch_scalar_in_an_empty_batch_is_kept_as_it_is() -> None:
    def with_scale(samples: list[Any]) -> dict[str, torch.Tensor]:
        return {"x": default_collate(samples)[0], "scale": torch.tensor(0.5)}

    (batch,) = _batches_of_rank_1(TensorDataset(torch.ones(1, 2)), with_scale)
    assert batch["x"].shape == (0, 2)
    assert batch["scale"].item() == 0.5


# -- in a real group of two processes: the gradient hook and the gather of a step -----------------


class Bucket:
    """What DDP hands its communication hook: a flat buffer of gradients (all the hook reads)."""

    def __init__(self, gradient: torch.Tensor) -> None:
        self._gradient = gradient

    def buffer(self) -> torch.Tensor:
        return self._gradient


def _loader(rank: int, dataset_len: int) -> DistributedLoader:
    data = DataLoader(TensorDataset(torch.arange(dataset_len, dtype=torch.float64)), batch_size=1)
    return DistributedLoader(data, batch_size=2, rank=rank, world_size=2, device=CPU, seed=0)


def hooked_means(rank: int, dataset_len: int) -> list[float]:
    """Each step's gradient after the hook, when a rank's gradient is the mean of its samples.

    The mean over no sample is nan, as a loss over an empty batch may be.
    """
    loader = _loader(rank, dataset_len)
    state = SampleWeights(world_size=2, context=loader.context)  # as prepare() hands it
    return [
        weighted_allreduce(state, Bucket(batch[0].mean().reshape(1))).wait().item()  # type: ignore[arg-type]
        for batch in loader
    ]


def gathered(rank: int, dataset_len: int) -> list[list[float]]:
    """Each step's samples gathered from both ranks for a metric."""
    return [dist.gather_for_metrics(batch[0]).tolist() for batch in _loader(rank, dataset_len)]


def prepare_your_ddp(rank: int) -> str:
    """prepare() of a model the caller wrapped in DDP, with an optimizer and a loader."""
    model = nn.parallel.DistributedDataParallel(nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        dist.prepare(model, opt, _ids(8), per_device_batch_size=2)
    except InvalidArgumentError as exc:
        return f"{exc.message} {exc.hint}"
    return "prepared"


@pytest.fixture(scope="class")
def other_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as other:
        yield other


class TestInAGroupOfTwoProcesses:
    """Rank 0 is this process; the group lives only while these tests run, so that the
    tests above see a single process whatever the order."""

    def test_the_hook_gives_every_rank_the_gradient_of_the_whole_global_batch(
        self, other_rank: OtherRank
    ) -> None:
        # Global batches [0, 1, 2, 3] (shares of 2 and 2) and [4, 5, 6] (shares [4, 5] and
        # [6]): their means are 1.5 and 5, which 2/3 * 4.5 + 1/3 * 6 gives (halves: 5.25).
        other_rank.run(hooked_means, 7)
        here = hooked_means(0, 7)
        assert (here, other_rank.result()) == (pytest.approx([1.5, 5.0]),) * 2

    def test_the_hook_counts_an_empty_share_as_no_gradient_even_a_nan_one(
        self, other_rank: OtherRank
    ) -> None:
        # The last global batch is [4], all of it rank 0's; rank 1's mean over nothing is nan.
        other_rank.run(hooked_means, 5)
        here = hooked_means(0, 5)
        assert (here, other_rank.result()) == ([1.5, 4.0], [1.5, 4.0])

    def test_a_model_wrapped_in_ddp_by_the_caller_is_refused_for_the_step_on_every_rank(
        self, other_rank: OtherRank
    ) -> None:
        # Its all-reduce averages every rank's gradient equally; the step weighs them by
        # their samples as well: the gradients came out 1/N of the whole batch's.
        other_rank.run(prepare_your_ddp)
        here = prepare_your_ddp(0)
        assert here == other_rank.result()
        assert "already wrapped in DDP" in here
        assert "Pass the bare model" in here

    def test_a_gather_for_a_metric_holds_each_sample_of_the_global_batch_once(
        self, other_rank: OtherRank
    ) -> None:
        other_rank.run(gathered, 5)
        here = gathered(0, 5)
        assert (here, other_rank.result()) == ([[0, 1, 2, 3], [4]],) * 2


# -- forked workers and this process's garbage ---------------------------------------------------


def test_forked_workers_never_collect_a_process_group_this_process_left_as_garbage(
    tmp_path: Path,
) -> None:
    # Destroying a group's C++ object in a worker, which has none of its threads, hangs the
    # worker (or aborts it); the loader collects this process's garbage before it forks.
    script = Path(__file__).parent / "scripts" / "loader_after_a_group.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["4"]


class Slow(Dataset[torch.Tensor]):
    """Each sample takes a while, so that the workers are still busy when the signal comes."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.05)
        return torch.tensor([index, os.getpid()])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_workers_outlive_a_stop_signal_sent_to_the_whole_process_group(
    signum: signal.Signals,
) -> None:
    """Slurm signals every process of a step, torchrun a worker's whole group: the stop is the
    served process's to make (Preemption, at the end of a step), not a worker's death."""
    data = DataLoader(Slow(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    loader = DistributedLoader(data, batch_size=2, rank=0, world_size=1, device=CPU, seed=0)
    seen: list[int] = []
    workers: set[int] = set()
    served = signal.getsignal(signum)
    try:
        for batch in loader:
            seen.extend(batch[:, 0].tolist())
            workers.update(batch[:, 1].tolist())
            if len(seen) == 4:  # a batch from each worker, both still loading
                assert len(workers) == 2
                # The served process handles it (as Preemption does), after the workers
                # started: they inherited no handler of it.
                signal.signal(signum, lambda *_: None)
                for pid in workers:
                    os.kill(pid, signum)
    finally:
        signal.signal(signum, served)
    assert sorted(seen) == list(range(16))
