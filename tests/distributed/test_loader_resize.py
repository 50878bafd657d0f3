"""A loader resumed with another global batch size: the rest of the epoch is cut from the saved
position, every remaining sample comes once, and the sizes the step weighs are the real ones.

A global batch changes on resume when the number of processes changes under
``per_device_batch_size`` (or when the user picks another size). The loader runs the same code
for each rank of a group, so the ranks here are loaders of one process, as in
``tests/train/test_loader_position.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit.distributed.data import DistributedLoader
from gpukit.train.step import TrainStep


def _loader(
    n: int,
    per_rank: int,
    *,
    rank: int = 0,
    world: int = 1,
    accumulate: int = 1,
    drop_last: bool = False,
    train_step: TrainStep | None = None,
) -> DistributedLoader:
    inner = DataLoader(
        TensorDataset(torch.arange(n)), batch_size=per_rank, shuffle=True, drop_last=drop_last
    )
    return DistributedLoader(
        inner,
        batch_size=per_rank,
        rank=rank,
        world_size=world,
        device=torch.device("cpu"),
        seed=3,
        accumulate=accumulate,
        train_step=train_step,
    )


def _stopped_after(steps: int, loader: DistributedLoader) -> dict[str, int]:
    batches = iter(loader)
    for _ in range(steps):
        next(batches)
    return loader.state_dict()


def _order(n: int) -> list[int]:
    """The epoch-0 order of every loader here (seed 3)."""
    return [int(i) for (x,) in _loader(n, n) for i in x]


class _Seen:
    """One rank's pass: each batch's samples and the sizes the loader reported for it."""

    def __init__(self, loader: DistributedLoader) -> None:
        self.samples: list[list[int]] = []
        self.reported: list[tuple[int, int]] = []
        self.placed: list[tuple[int, int, int | None, int | None]] = []
        for (x,) in loader:
            self.samples.append(x.tolist())
            self.reported.append((loader.current_len, loader.current_global_len))
            if loader.train_step is not None:
                ctx = loader.context
                self.placed.append((ctx.index, ctx.length, ctx.samples, ctx.window_samples))


def _resumed(
    state: dict[str, int], n: int, per_rank: int, world: int, **options: Any
) -> list[_Seen]:
    loaders = [_loader(n, per_rank, rank=r, world=world, **options) for r in range(world)]
    for loader in loaders:
        loader.load_state_dict(state)
    return [_Seen(loader) for loader in loaders]


def _global(seen: list[_Seen]) -> list[list[int]]:
    """The ranks' shares of each step joined in rank order: the global batches handed out."""
    return [
        [i for share in shares for i in share]
        for shares in zip(*(s.samples for s in seen), strict=True)
    ]


@pytest.mark.parametrize(
    ("n", "saved_batch", "resumed_batch", "stop"),
    [(48, 8, 12, 2), (30, 4, 6, 1), (24, 8, 12, 1), (50, 8, 12, 1), (50, 12, 8, 1)],
)
def test_a_resume_with_another_global_batch_cuts_the_rest_of_the_epoch_from_the_saved_position(
    n: int, saved_batch: int, resumed_batch: int, stop: int
) -> None:
    state = _stopped_after(stop, _loader(n, saved_batch))
    rest = _order(n)[stop * saved_batch :]
    batches = _global(_resumed(state, n, resumed_batch, world=1))
    assert batches == [rest[i : i + resumed_batch] for i in range(0, len(rest), resumed_batch)]


def test_two_processes_resumed_on_three_with_the_same_per_device_batch_see_the_rest_once() -> None:
    saved = [_loader(40, 4, rank=r, world=2) for r in range(2)]
    states = [_stopped_after(3, loader) for loader in saved]
    assert states[0] == states[1]
    seen = _resumed(states[0], 40, 4, world=3)
    batches = _global(seen)
    assert [i for b in batches for i in b] == _order(40)[24:]
    assert [len(b) for b in batches] == [12, 4]


def test_each_batch_after_a_resize_is_reported_with_its_real_sizes() -> None:
    state = _stopped_after(1, _loader(50, 8))  # 42 left, in global batches of 12 over 3
    seen = _resumed(state, 50, 4, world=3)
    assert [len(b) for b in _global(seen)] == [12, 12, 12, 6]
    for rank_seen in seen:
        assert rank_seen.reported == [
            (len(share), whole)
            for share, whole in zip(rank_seen.samples, [12, 12, 12, 6], strict=True)
        ]


def _train_step(accumulate: int) -> TrainStep:
    model = nn.Linear(1, 1)
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=accumulate)


def test_the_accumulation_windows_after_a_resize_start_at_the_saved_position_with_real_sizes() -> (
    None
):
    state = _stopped_after(1, _loader(50, 8))  # 8 of 50 consumed: 42 left
    (seen,) = _resumed(state, 50, 4, world=1, accumulate=3, train_step=_train_step(3))
    sizes = [len(b) for b in seen.samples]
    assert sizes == [4] * 10 + [2]  # windows of 12, 12, 12, then 4 + 2
    expected = []
    for i, size in enumerate(sizes):
        first = i - i % 3
        window = sizes[first : first + 3]
        expected.append((i % 3, len(window), size, sum(window)))
    assert seen.placed == expected


def test_with_drop_last_every_step_after_a_resize_sees_a_whole_global_batch() -> None:
    state = _stopped_after(1, _loader(50, 8, drop_last=True))  # 42 left: three windows of 12
    resumed = _loader(50, 4, accumulate=3, drop_last=True)
    resumed.load_state_dict(state)
    (seen,) = [_Seen(resumed)]
    assert [len(b) for b in seen.samples] == [4] * 9
    assert resumed.state_dict()["epoch"] == 1
    assert resumed.state_dict()["consumed"] == 0


def test_a_state_saved_after_a_resize_resumes_with_a_third_size_exactly_where_it_stopped() -> None:
    first = _stopped_after(1, _loader(50, 8))
    second = _loader(50, 12)
    second.load_state_dict(first)
    state = _stopped_after(2, second)
    assert state["consumed"] == 8 + 24
    batches = _global(_resumed(state, 50, 5, world=1))
    assert [i for b in batches for i in b] == _order(50)[32:]
    assert [len(b) for b in batches] == [5, 5, 5, 3]


@settings(max_examples=60, deadline=None)
@given(
    samples=st.integers(1, 70),
    saved_batch=st.integers(1, 15),
    resumed=st.tuples(st.integers(1, 5), st.sampled_from([1, 2, 3])),
    accumulate=st.integers(1, 3),
    data=st.data(),
)
def test_any_resize_at_any_stop_deals_out_the_rest_once_with_the_sizes_reported_right(
    samples: int,
    saved_batch: int,
    resumed: tuple[int, int],
    accumulate: int,
    data: st.DataObject,
) -> None:
    per_rank, world = resumed
    # The position counts samples of the global order, whatever the world size that saved it.
    stop = data.draw(st.integers(0, len(_loader(samples, saved_batch))), label="stop")
    state = _stopped_after(stop, _loader(samples, saved_batch))
    loaders = [
        _loader(
            samples,
            per_rank,
            rank=r,
            world=world,
            accumulate=accumulate,
            train_step=_train_step(accumulate),
        )
        for r in range(world)
    ]
    for loader in loaders:
        loader.load_state_dict(state)
    seen = [_Seen(loader) for loader in loaders]
    batches = _global(seen)
    if state["epoch"] == 1:  # the epoch was over: the next one comes whole
        assert sorted(i for b in batches for i in b) == list(range(samples))
    else:
        assert [i for b in batches for i in b] == _order(samples)[state["consumed"] :]
    sizes = [len(b) for b in batches]
    assert all(size == per_rank * world for size in sizes[:-1])
    for rank_seen in seen:
        assert [g for _, g in rank_seen.reported] == sizes
        assert [n for n, _ in rank_seen.reported] == [len(s) for s in rank_seen.samples]
        windows = [
            sum(sizes[i - i % accumulate : i - i % accumulate + accumulate])
            for i in range(len(sizes))
        ]
        assert [w for *_, w in rank_seen.placed] == windows


def test_training_resumed_with_another_global_batch_takes_the_steps_of_the_new_cut() -> None:
    # Saved after one step of 8 samples; resumed with micro-batches of 4, three per step (12):
    # the rest of the epoch (42 samples) is three steps of 12 and one of 6 (4 + 2), each the
    # step one process takes on that whole global batch.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(50, 3, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    reference = nn.Linear(3, 1).double()
    reference.load_state_dict(model.state_dict())
    state = _stopped_after(1, _loader(50, 8))

    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    inner = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    resumed = DistributedLoader(
        inner,
        batch_size=4,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        seed=3,
        accumulate=3,
        train_step=step,
    )
    resumed.load_state_dict(state)
    stepped = [step(nn.functional.mse_loss(model(xb), yb)) for xb, yb in resumed]
    assert stepped.count(True) == 4

    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    rest = _order(50)[8:]
    for first in range(0, len(rest), 12):
        batch = rest[first : first + 12]
        opt.zero_grad()
        nn.functional.mse_loss(reference(x[batch]), y[batch]).backward()
        opt.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
