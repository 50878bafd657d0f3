"""Whether a model is sharded over processes: gpukit's one answer, light enough to import
anywhere (``prepare`` asks it of every model; the sharded checkpoint code is loaded only for
a model that is)."""

from __future__ import annotations

import sys
from collections.abc import Mapping

from torch import nn

__all__ = ["dtensor_type", "is_sharded", "models_in"]


def dtensor_type() -> type | None:
    """torch's DTensor class, or None while no DTensor can exist: none can before
    ``torch.distributed.tensor`` is imported, and a plain save does not pay for importing it."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def models_in(obj: object) -> list[nn.Module]:
    """The models ``obj`` is or holds: itself, or the values of a dict that are models."""
    if isinstance(obj, nn.Module):
        return [obj]
    if isinstance(obj, Mapping):
        return [v for v in obj.values() if isinstance(v, nn.Module)]
    return []


def is_sharded(obj: object) -> bool:
    """Whether ``obj`` is a model sharded over processes, or a dict that holds one.

    A model is sharded when any of its parameters is a DTensor (``fully_shard``, FSDP2, makes
    every parameter of the modules it wraps one); gpukit's one answer to that question, for
    saving, loading, the training state and ``prepare``. It never imports torch's DTensor
    module itself (a plain save does not pay for it): no DTensor exists before that module.

    >>> is_sharded(nn.Linear(2, 2))
    False

    Args:
        obj: anything; a module, or a dict of modules and other values, may be sharded.
    """
    dtensor = dtensor_type()
    if dtensor is None:
        return False
    return any(isinstance(p, dtensor) for m in models_in(obj) for p in m.parameters())
