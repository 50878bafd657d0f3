"""The distributed loader's saved position: checked before use; and each pass's worker seeds.

A loader's state is the epoch and the number of samples of that epoch's global order already
handed out (see ``DistributedLoader.state_dict``). It comes back from a file, so every field is
checked, and a state of another order of samples (dataset length, seed, shuffle) is refused.
"""

from __future__ import annotations

import hashlib

from gpukit.errors import InvalidArgumentError

__all__ = ["checked_position", "worker_base"]


def worker_base(seed: int, epoch: int, rank: int) -> int:
    """The seed of a pass's worker seeds: one per (seed, epoch, rank), spread over 63 bits."""
    digest = hashlib.sha256(f"{seed}:{epoch}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def checked_position(
    state: object, *, seed: int, shuffle: bool, dataset_len: int
) -> tuple[int, int]:
    """The (epoch, consumed) of a saved loader state, checked against this loader's data."""
    if not isinstance(state, dict):
        raise InvalidArgumentError(
            f"DistributedLoader.load_state_dict got a {type(state).__name__}, not a loader state.",
            hint="Pass what DistributedLoader.state_dict() returned.",
        )
    fields = {}
    for name in ("epoch", "consumed", "seed", "shuffle", "dataset_len"):
        value = state.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgumentError(
                f"the loader state's {name!r} is {value!r}, not a whole number >= 0.",
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
