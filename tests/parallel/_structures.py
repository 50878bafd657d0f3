"""Hypothesis strategies for nested batches, shared by the scatter and gather tests."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

Pair = namedtuple("Pair", ["left", "right"])


@dataclass(frozen=True)
class Frozen:
    """A frozen dataclass, the hardest container to rebuild."""

    value: Any
    tag: Any


def batches(size: int, *, leaves: bool = True) -> st.SearchStrategy[Any]:
    """Nested batches whose tensors all hold ``size`` samples along dim 0."""
    tensor = st.integers(0, 2).flatmap(
        lambda ndim: st.builds(
            lambda seed: torch.randn(
                size, *([2] * ndim), generator=torch.Generator().manual_seed(seed)
            ),
            st.integers(0, 2**16),
        )
    )
    base: st.SearchStrategy[Any] = tensor
    if leaves:
        base = st.one_of(tensor, st.integers(), st.text(max_size=3), st.none())
    return st.recursive(
        base,
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=3),
            st.lists(inner, min_size=1, max_size=3).map(tuple),
            st.dictionaries(st.sampled_from("abc"), inner, min_size=1, max_size=3),
            st.dictionaries(st.sampled_from("xyz"), inner, min_size=1, max_size=2).map(OrderedDict),
            st.builds(Pair, inner, inner),
            st.builds(Frozen, inner, inner),
        ),
        max_leaves=6,
    )


def same_structure(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same nesting with equal tensors and leaves."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_structure(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_structure(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Frozen):
        return same_structure(a.value, b.value) and same_structure(a.tag, b.tag)
    return bool(a == b)


def map_tensors_and_leaves(batch: Any, *, replicas: int) -> Any:
    """What gathering ``replicas`` scattered copies of ``batch`` gives: leaves become lists."""
    if isinstance(batch, torch.Tensor):
        return batch
    if batch is None:
        return None
    if isinstance(batch, dict):
        return type(batch)(
            (k, map_tensors_and_leaves(v, replicas=replicas)) for k, v in batch.items()
        )
    if isinstance(batch, Pair):
        return Pair(*(map_tensors_and_leaves(v, replicas=replicas) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors_and_leaves(v, replicas=replicas) for v in batch)
    if isinstance(batch, Frozen):
        return Frozen(
            map_tensors_and_leaves(batch.value, replicas=replicas),
            map_tensors_and_leaves(batch.tag, replicas=replicas),
        )
    return [batch] * replicas
