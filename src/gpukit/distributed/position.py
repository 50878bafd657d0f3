"""The distributed loader's saved position: checked before use; and each pass's worker seeds.

A loader's state is the epoch and the number of samples of that epoch's global order already
handed out (see ``DistributedLoader.state_dict``). It comes back from a file, so every field is
checked, and a state of another order of samples (dataset length, seed, shuffle) is refused.

The seed and the epoch have one range each, the same for what ``prepare()`` and the loader take
and for what a saved position may hold, so a loader never runs what it could not resume. An
epoch's shuffle is seeded with ``seed + epoch``, which ``torch.Generator.manual_seed`` takes up
to 2**64 - 1: two ranges of 0 to 2**63 - 1 keep the sum inside it.
"""

from __future__ import annotations

import hashlib

from gpukit.errors import InvalidArgumentError

__all__ = [
    "MAX_EPOCH",
    "MAX_SEED",
    "checked_epoch",
    "checked_position",
    "checked_seed",
    "worker_base",
]

MAX_SEED = 2**63 - 1
"""The largest seed of a prepared loader's shuffle."""
MAX_EPOCH = 2**63 - 1
"""The largest epoch a prepared loader shuffles for (set_epoch, a saved position)."""


def worker_base(seed: int, epoch: int, rank: int) -> int:
    """The seed of a pass's worker seeds: one per (seed, epoch, rank), spread over 63 bits."""
    digest = hashlib.sha256(f"{seed}:{epoch}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _whole_in_range(value: object, largest: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= largest


def checked_seed(seed: object) -> int:
    """The seed of a loader's shuffle, checked: a whole number from 0 to :data:`MAX_SEED`.

    Raises:
        InvalidArgumentError: ``seed`` is not an int (a bool, a float, a string), or is outside
            that range (a negative seed would be saved, and its position refused on resume).
    """
    if not _whole_in_range(seed, MAX_SEED):
        raise InvalidArgumentError(
            f"seed={seed!r} is not a whole number from 0 to 2**63 - 1, the seeds a loader "
            "shuffles with and resumes from.",
            hint="Pass an int in that range, for example seed=0, or seed % 2**63.",
        )
    assert isinstance(seed, int)
    return seed


def checked_epoch(epoch: object) -> int:
    """An epoch given to ``set_epoch``, checked: a whole number from 0 to :data:`MAX_EPOCH`.

    Raises:
        InvalidArgumentError: ``epoch`` is not an int, or is outside that range.
    """
    if not _whole_in_range(epoch, MAX_EPOCH):
        raise InvalidArgumentError(
            f"set_epoch({epoch!r}): an epoch is a whole number from 0 to 2**63 - 1.",
            hint="Pass the number of the pass, counting from 0, such as set_epoch(epoch) in "
            "`for epoch in range(epochs):`.",
        )
    assert isinstance(epoch, int)
    return epoch


def checked_position(
    state: object, *, seed: int, shuffle: bool, dataset_len: int
) -> tuple[int, int]:
    """The (epoch, consumed) of a saved loader state, checked against this loader's data.

    Raises:
        InvalidArgumentError: the state is not a dict of whole numbers in their ranges (an
            epoch or seed above 2**63 - 1, more samples consumed than the dataset holds), or it
            describes another order of samples (dataset length, seed, shuffle).
    """
    if not isinstance(state, dict):
        raise InvalidArgumentError(
            f"DistributedLoader.load_state_dict got a {type(state).__name__}, not a loader state.",
            hint="Pass what DistributedLoader.state_dict() returned.",
        )
    largest = {"epoch": MAX_EPOCH, "seed": MAX_SEED}  # what a loader reaches (module doc)
    fields = {}
    for name in ("epoch", "consumed", "seed", "shuffle", "dataset_len"):
        value = state.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgumentError(
                f"the loader state's {name!r} is {value!r}, not a whole number >= 0.",
                hint="Pass what DistributedLoader.state_dict() returned, unchanged.",
            )
        if value > largest.get(name, value):
            raise InvalidArgumentError(
                f"the loader state's {name!r} is {value}, above 2**63 - 1, the largest {name} "
                "a loader runs with: no loader saved it.",
                hint="Pass what DistributedLoader.state_dict() returned, unchanged.",
            )
        fields[name] = value
    mine = {"seed": seed, "shuffle": int(shuffle), "dataset_len": dataset_len}
    for name, value in mine.items():
        if fields[name] != value:
            raise InvalidArgumentError(
                f"the loader state was saved with {name}={fields[name]}, this loader has "
                f"{name}={value}: its order of samples is another one, so the position in it "
                "means nothing here.",
                hint="Resume with the dataset, seed and shuffle the run started with.",
            )
    if fields["consumed"] > dataset_len:
        raise InvalidArgumentError(
            f"the loader state says {fields['consumed']} samples of the epoch were consumed, "
            f"but the dataset has {dataset_len}.",
            hint="Pass what DistributedLoader.state_dict() returned, unchanged.",
        )
    return fields["epoch"], fields["consumed"]
