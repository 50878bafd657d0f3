"""``to_device`` on nested batches against accelerate's and Lightning's movers.

CPU to CPU, so nothing is copied: the figure is the pure cost of walking the structure, which
every training step pays once per batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from gpukit import tree_map
from gpukit.bench.core import BenchResult, compare
from gpukit.transfer import to_device

SUITE = "transfer"


@dataclasses.dataclass
class _Sample:
    image: torch.Tensor
    mask: torch.Tensor
    boxes: list[torch.Tensor]
    label: int


class _Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


def mixed_batch() -> dict[str, Any]:
    """The batch of a typical multi-input model: 40 tensors in a list, 20 namedtuples of two
    tensors, a small dict of tensors, strings and ints, and 10 nested dicts each holding a
    tensor and a tuple (122 tensors)."""
    return {
        "features": [torch.zeros(4) for _ in range(40)],
        "pairs": [_Pair(torch.zeros(2), torch.ones(2)) for _ in range(20)],
        "info": {"mask": torch.ones(3), "lengths": torch.ones(3), "name": "batch-1", "step": 3},
        "regions": [{"box": torch.zeros(4), "extra": (torch.ones(1), i)} for i in range(10)],
    }


def nested_batch(n_tensors: int = 100, *, dataclasses_too: bool = True) -> dict[str, Any]:
    """A dict of about ``n_tensors`` small tensors in lists, tuples and (optionally) dataclasses.

    With ``dataclasses_too=False`` each sample is a dict instead, a structure that every mover
    compared here walks in full.
    """

    def sample(i: int) -> Any:
        fields: dict[str, Any] = {
            "image": torch.zeros(3, 8, 8),
            "mask": torch.ones(8, 8),
            "boxes": [torch.zeros(4), torch.zeros(4)],
            "label": i,
        }
        return _Sample(**fields) if dataclasses_too else fields

    return {
        "samples": [sample(i) for i in range(n_tensors // 5)],
        "text": {"ids": torch.zeros(16, dtype=torch.long), "lengths": (torch.ones(1), 3)},
        "meta": {"names": ["a", "b"], "epoch": 1},
    }


def _count_tensors(obj: Any) -> int:
    found: list[torch.Tensor] = []
    tree_map(found.append, obj)
    return len(found)


def _alternatives(batch: Any, device: torch.device) -> dict[str, Callable[[], object]]:
    found: dict[str, Callable[[], object]] = {}
    try:
        from accelerate.utils import send_to_device
    except ImportError:
        pass
    else:
        found["accelerate.send_to_device"] = lambda: send_to_device(batch, device)
    try:
        from lightning.fabric.utilities.apply_func import move_data_to_device
    except ImportError:
        pass
    else:
        found["lightning.move_data_to_device"] = lambda: move_data_to_device(batch, device)
    return found


def _measure(batch: Any, label: str, quick: bool, target: float | None) -> list[BenchResult]:
    device = torch.device("cpu")
    candidates: dict[str, Callable[[], object]] = {
        "gpukit.to_device": lambda: to_device(batch, device)
    }
    alternatives = _alternatives(batch, device)
    candidates.update(alternatives)
    times = compare(candidates, repeat=5 if quick else 15, number=20 if quick else 200)
    ours = times["gpukit.to_device"] * 1e6
    name = f"to_device, {_count_tensors(batch)} tensors {label}, cpu->cpu"
    if not alternatives:
        note = "accelerate and lightning are not installed (pip install 'gpukit[bench]')"
        return [BenchResult(SUITE, name, ours, "us/call", note=note)]
    results = []
    for alt in alternatives:
        note = ""
        if alt.startswith("accelerate") and "dataclass" in label:
            note = "accelerate does not look inside dataclasses: it moves only 2 of the tensors"
        goal = alt.startswith("accelerate") and not note
        results.append(
            BenchResult(
                SUITE,
                name,
                ours,
                "us/call",
                baseline_name=alt,
                baseline_value=times[alt] * 1e6,
                target=f"<= {target:g}" if goal and target is not None else None,
                target_ratio=target if goal else None,
                note=note,
            )
        )
    return results


def run(quick: bool = False) -> list[BenchResult]:
    """Time each mover on the same nested batches, interleaved."""
    return [
        *_measure(mixed_batch(), "in lists, namedtuples and dicts", quick, 0.5),
        *_measure(nested_batch(dataclasses_too=False), "in dicts/lists", quick, 0.46),
        *_measure(nested_batch(), "in dataclasses/lists", quick, None),
    ]
