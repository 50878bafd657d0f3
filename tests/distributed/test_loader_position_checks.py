"""The loader position's checks, each refusal read whole, and the worker seeds written down.

A saved position comes back from a file: every field is checked, and each refusal tells what
was wrong and what to pass. The worker seeds are pinned: a run resumed by a later gpukit must
give its loader workers the seeds the uninterrupted run gave them.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpukit.distributed.position import (
    MAX_EPOCH,
    MAX_SEED,
    checked_epoch,
    checked_position,
    checked_seed,
    worker_base,
)
from gpukit.errors import InvalidArgumentError

SAVED = {"epoch": 1, "consumed": 4, "seed": 3, "shuffle": 1, "dataset_len": 10}
UNCHANGED = "Pass what DistributedLoader.state_dict() returned, unchanged."


def _refusal(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(InvalidArgumentError) as refused:
        call(*args, **kwargs)
    return str(refused.value)


def _position(**changes: Any) -> tuple[int, int]:
    return checked_position({**SAVED, **changes}, seed=3, shuffle=True, dataset_len=10)


def test_worker_seeds_stay_what_they_were() -> None:
    assert worker_base(0, 0, 0) == 2696329656458929524
    assert worker_base(3, 2, 1) == 8652796697206716555


def test_the_largest_seed_and_epoch_are_accepted_and_one_more_is_refused() -> None:
    assert checked_seed(MAX_SEED) == MAX_SEED == 2**63 - 1
    assert checked_epoch(MAX_EPOCH) == MAX_EPOCH == 2**63 - 1
    assert checked_seed(0) == checked_epoch(0) == 0
    seed = (
        "seed={} is not a whole number from 0 to 2**63 - 1, the seeds a loader shuffles with "
        "and resumes from. Pass an int in that range, for example seed=0, or seed % 2**63."
    )
    for bad in (2**63, -1, True, 1.0):
        assert _refusal(checked_seed, bad) == seed.format(repr(bad))
    epoch = (
        "set_epoch({}): an epoch is a whole number from 0 to 2**63 - 1. Pass the number of the "
        "pass, counting from 0, such as set_epoch(epoch) in `for epoch in range(epochs):`."
    )
    for bad in (2**63, -1, True, "1"):
        assert _refusal(checked_epoch, bad) == epoch.format(repr(bad))


def test_a_position_at_the_bounds_is_read_back() -> None:
    assert _position() == (1, 4)
    assert _position(consumed=10, epoch=MAX_EPOCH) == (MAX_EPOCH, 10)
    assert _position(consumed=0, epoch=0) == (0, 0)


@pytest.mark.parametrize(
    ("state", "text"),
    [
        (
            "x",
            "DistributedLoader.load_state_dict got a str, not a loader state. Pass what "
            "DistributedLoader.state_dict() returned.",
        ),
        (
            {**SAVED, "epoch": -1},
            f"the loader state's 'epoch' is -1, not a whole number >= 0. {UNCHANGED}",
        ),
        (
            {**SAVED, "shuffle": True},
            f"the loader state's 'shuffle' is True, not a whole number >= 0. {UNCHANGED}",
        ),
        (
            {k: v for k, v in SAVED.items() if k != "consumed"},
            f"the loader state's 'consumed' is None, not a whole number >= 0. {UNCHANGED}",
        ),
        (
            {**SAVED, "seed": 2**63},
            "the loader state's 'seed' is 9223372036854775808, above 2**63 - 1, the largest seed "
            f"a loader runs with: no loader saved it. {UNCHANGED}",
        ),
        (
            {**SAVED, "epoch": 2**63},
            "the loader state's 'epoch' is 9223372036854775808, above 2**63 - 1, the largest "
            f"epoch a loader runs with: no loader saved it. {UNCHANGED}",
        ),
        (
            {**SAVED, "seed": 4},
            "the loader state was saved with seed=4, this loader has seed=3: its order of "
            "samples is another one, so the position in it means nothing here. Resume with the "
            "dataset, seed and shuffle the run started with.",
        ),
        (
            {**SAVED, "shuffle": 0},
            "the loader state was saved with shuffle=0, this loader has shuffle=1: its order of "
            "samples is another one, so the position in it means nothing here. Resume with the "
            "dataset, seed and shuffle the run started with.",
        ),
        (
            {**SAVED, "dataset_len": 11},
            "the loader state was saved with dataset_len=11, this loader has dataset_len=10: its "
            "order of samples is another one, so the position in it means nothing here. Resume "
            "with the dataset, seed and shuffle the run started with.",
        ),
        (
            {**SAVED, "consumed": 11},
            "the loader state says 11 samples of the epoch were consumed, but the dataset has "
            f"10. {UNCHANGED}",
        ),
    ],
)
def test_each_refused_position_says_what_is_wrong_and_what_to_pass(state: Any, text: str) -> None:
    assert _refusal(checked_position, state, seed=3, shuffle=True, dataset_len=10) == text
