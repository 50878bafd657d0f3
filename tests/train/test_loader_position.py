"""The distributed loader's position: samples of the epoch's order, resumed by arithmetic."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, get_worker_info

from gpukit.distributed.data import DistributedLoader
from gpukit.errors import InvalidArgumentError


class Ids(Dataset[int]):
    """Sample i is i; counts how many samples were fetched."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.fetched = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.fetched += 1
        return index


def _loader(
    data: Ids, *, rank: int = 0, world: int = 1, global_batch: int = 6, workers: int = 0
) -> DistributedLoader:
    inner = DataLoader(data, batch_size=global_batch, shuffle=True, num_workers=workers)
    return DistributedLoader(
        inner,
        batch_size=global_batch // world,
        rank=rank,
        world_size=world,
        device=torch.device("cpu"),
        seed=3,
    )


def _global_batches(loaders: list[DistributedLoader]) -> list[list[int]]:
    """One pass of every rank's loader, each step's shares joined in rank order."""
    passes = [[b.tolist() for b in loader] for loader in loaders]
    return [[i for share in shares for i in share] for shares in zip(*passes, strict=True)]


def _stopped_after(steps: int, world: int, n: int = 43) -> dict[str, int]:
    loader = _loader(Ids(n), world=world)
    batches = iter(loader)
    for _ in range(steps):
        next(batches)
    return loader.state_dict()


def test_a_resumed_loader_hands_out_exactly_the_rest_of_the_epoch() -> None:
    whole = _global_batches([_loader(Ids(43))])
    resumed = _loader(Ids(43))
    resumed.load_state_dict(_stopped_after(3, world=1))
    assert _global_batches([resumed]) == whole[3:]


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 1), (1, 3), (3, 2)])
def test_the_rest_of_the_epoch_is_dealt_out_again_over_another_number_of_processes(
    saved_on: int, resumed_on: int
) -> None:
    whole = _global_batches([_loader(Ids(43))])
    state = _stopped_after(4, world=saved_on)
    resumed = [_loader(Ids(43), rank=r, world=resumed_on) for r in range(resumed_on)]
    for loader in resumed:
        loader.load_state_dict(state)
    assert _global_batches(resumed) == whole[4:]  # none repeated, none skipped, same batches


def test_resuming_late_in_an_epoch_fetches_only_the_samples_still_to_come() -> None:
    data = Ids(60_000)
    resumed = _loader(data, global_batch=6)
    resumed.load_state_dict(_stopped_after(9_998, world=1, n=60_000))
    assert len(list(resumed)) == 2
    assert data.fetched == 12  # the 9,998 batches before were not replayed


def test_the_position_counts_samples_the_same_for_any_world_size() -> None:
    assert _stopped_after(5, world=1) == _stopped_after(5, world=2) == _stopped_after(5, world=3)
    assert _stopped_after(5, world=1)["consumed"] == 30


def test_after_the_epochs_last_batch_the_state_points_at_the_next_epoch() -> None:
    assert _stopped_after(8, world=1)["epoch"] == 1
    assert _stopped_after(8, world=1)["consumed"] == 0


def test_a_pass_left_early_is_continued_by_the_next_pass() -> None:
    whole = _global_batches([_loader(Ids(43))])
    loader = _loader(Ids(43))
    for step, _ in enumerate(loader):
        if step == 2:
            break
    assert _global_batches([loader]) == whole[3:]
    assert loader.epoch == 1


def _draws(loader: DistributedLoader) -> list[float]:
    """What the loop body draws from the process's torch stream, batch by batch."""
    return [torch.rand(()).item() for _ in loader]


def test_a_resumed_pass_draws_what_the_uninterrupted_pass_drew() -> None:
    # The stream is seeded per micro-batch from its place in the epoch's order, whatever the
    # process's stream held before: a resumed pass, on its workers too, draws alike.
    whole = _draws(_loader(Ids(43), workers=2))
    resumed = _loader(Ids(43), workers=2)
    resumed.load_state_dict(_stopped_after(3, world=1))
    torch.manual_seed(12345)  # another process's stream
    assert _draws(resumed) == whole[3:]
    assert len(set(whole)) == len(whole)  # no two micro-batches draw alike


def test_the_shares_of_one_global_batch_draw_different_streams() -> None:
    # Each rank's share starts at another sample of the order: no rank draws another's mask.
    ranks = [_draws(_loader(Ids(42), rank=r, world=3)) for r in range(3)]
    for step in zip(*ranks, strict=True):
        assert len(set(step)) == 3


class WorkerSeeds(Ids):
    """Sample i is the seed of the worker that loads it."""

    def __getitem__(self, index: int) -> int:
        info = get_worker_info()
        assert info is not None
        return int(info.seed) % (1 << 62)


def test_a_resumed_pass_gives_its_workers_the_seeds_of_the_uninterrupted_pass() -> None:
    whole = _loader(WorkerSeeds(43), workers=2)
    seeds = {s for batch in whole for s in batch.tolist()}
    resumed = _loader(WorkerSeeds(43), workers=2)
    resumed.load_state_dict(_stopped_after(3, world=1))
    assert {s for batch in resumed for s in batch.tolist()} == seeds
    assert len(seeds) == 2
    next_epoch = {s for batch in resumed for s in batch.tolist()}
    assert not next_epoch & seeds  # and another epoch gets other seeds


def test_set_epoch_to_the_resumed_epoch_keeps_the_position_another_starts_it_over() -> None:
    whole = _global_batches([_loader(Ids(43))])
    loader = _loader(Ids(43))
    loader.load_state_dict(_stopped_after(3, world=1))
    loader.set_epoch(0)
    assert _global_batches([loader]) == whole[3:]
    loader.set_epoch(0)
    assert _global_batches([loader]) == whole


@pytest.mark.parametrize(
    ("change", "named"),
    [({"seed": 4}, "seed"), ({"dataset_len": 44}, "dataset_len"), ({"shuffle": 0}, "shuffle")],
)
def test_a_state_of_another_order_of_samples_is_refused_naming_what_differs(
    change: dict[str, int], named: str
) -> None:
    state = {**_stopped_after(2, world=1), **change}
    loader = _loader(Ids(43))
    with pytest.raises(InvalidArgumentError, match=named):
        loader.load_state_dict(state)
    assert loader.state_dict()["consumed"] == 0  # nothing changed


@pytest.mark.parametrize("bad", [{"epoch": -1}, {"consumed": "3"}, {"consumed": 44}, []])
def test_a_malformed_loader_state_is_refused(bad: object) -> None:
    state = {**_stopped_after(2, world=1), **bad} if isinstance(bad, dict) else bad
    with pytest.raises(InvalidArgumentError):
        _loader(Ids(43)).load_state_dict(state)  # type: ignore[arg-type]


@settings(max_examples=60)
@given(
    samples=st.integers(1, 80),
    per_rank=st.integers(1, 4),
    saved_on=st.sampled_from([1, 2, 3, 6]),
    resumed_on=st.sampled_from([1, 2, 3, 6]),
    data=st.data(),
)
def test_any_stop_on_any_world_size_leaves_exactly_the_rest_of_the_epoch(
    samples: int, per_rank: int, saved_on: int, resumed_on: int, data: st.DataObject
) -> None:
    global_batch = 6 * per_rank  # divides over 1, 2, 3 and 6 processes
    whole = _global_batches([_loader(Ids(samples), global_batch=global_batch)])
    stop = data.draw(st.integers(0, len(whole)), label="stop")
    saved = _loader(Ids(samples), world=saved_on, global_batch=global_batch)
    batches = iter(saved)
    for _ in range(stop):
        next(batches)
    state = saved.state_dict()
    resumed = [
        _loader(Ids(samples), rank=r, world=resumed_on, global_batch=global_batch)
        for r in range(resumed_on)
    ]
    for loader in resumed:
        loader.load_state_dict(state)
    rest = _global_batches(resumed)
    if stop == len(whole):  # the epoch is over: the resumed pass is the next epoch, whole
        assert state["epoch"] == 1
        assert sorted(i for b in rest for i in b) == list(range(samples))
    else:
        assert rest == whole[stop:]
