"""Checkpoint keys: unwrap modules, find the state dict in a container, clean and match keys.

Three kinds of source put extra segments into state-dict keys. ``nn.DataParallel`` and
``DistributedDataParallel`` add ``module.``, which a real model may also use as a name, so it is
removed only where that is certain. Wrappers that keep the real module under an attribute of
their own add a segment no real module can have, anywhere in a key (around one block, too):
``torch.compile`` (``_orig_mod.``), FSDP (``_fsdp_wrapped_module.``), activation checkpointing
(``_checkpoint_wrapped_module.``) and Lightning Fabric (``_forward_module.``); these are removed
wherever they are. Training frameworks that hold the network as an attribute (``model.`` in a
Lightning checkpoint) add a third kind, removed only when a model is given and removing it is
what makes the keys match.
"""

from __future__ import annotations

import difflib
import sys
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "CONTAINER_KEYS",
    "WRAPPER_SEGMENTS",
    "FoundWeights",
    "KeyMatch",
    "clean_keys",
    "copy_metadata",
    "find_state_dict",
    "find_weights",
    "is_state_dict",
    "match_keys",
    "nearest",
    "unwrap",
]

_DP_PREFIX = "module."
# Attributes that wrapper classes own: no real module can be registered under these names, so a
# segment with one of them is a wrapper's wherever it appears in a key.
WRAPPER_SEGMENTS = (
    "_orig_mod",  # torch.compile's OptimizedModule
    "_fsdp_wrapped_module",  # FullyShardedDataParallel (FSDP1)
    "_checkpoint_wrapped_module",  # torch.distributed activation checkpointing's CheckpointWrapper
    "_forward_module",  # Lightning Fabric's _FabricModule
)

# Where checkpoints written by common training code keep the model's weights, most specific first.
CONTAINER_KEYS = (
    "state_dict",
    "model_state_dict",
    "model_state",
    "model",
    "module",
    "net",
    "network",
    "weights",
    "params",
)


def _wrapper_types() -> tuple[type[nn.Module], ...]:
    """The classes that hold the real module in ``.module``."""
    types: list[type[nn.Module]] = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    try:
        from gpukit.parallel.data_parallel import DataParallel
    except ImportError:  # the parallel package is optional at this layer
        pass
    else:
        types.append(DataParallel)
    return tuple(types)


def _compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module torch.compile wrapped, or None when ``module`` is not compiled."""
    # Looked up in sys.modules: importing torch._dynamo costs seconds, and no OptimizedModule
    # can exist unless torch.compile (which imports it) has run.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is not None and isinstance(module, optimized):
        inner = module._orig_mod
        assert isinstance(inner, nn.Module)
        return inner
    return None


def unwrap(module: nn.Module) -> tuple[nn.Module, list[str]]:
    """The innermost real module, and the wrapper class names removed, outermost first."""
    removed: list[str] = []
    wrappers = _wrapper_types()
    while True:
        inner = _compiled_inner(module)
        if inner is None and isinstance(module, wrappers):
            candidate = module.module
            inner = candidate if isinstance(candidate, nn.Module) else None
        if inner is None:
            return module, removed
        removed.append(type(module).__name__)
        module = inner


def is_state_dict(obj: object) -> bool:
    """A mapping of string keys to tensors (``_extra_state`` entries may hold anything)."""
    if not isinstance(obj, Mapping) or not obj:
        return False
    saw_tensor = False
    for key, value in obj.items():
        if not isinstance(key, str):
            return False
        if isinstance(value, torch.Tensor):
            saw_tensor = True
        elif not key.endswith("_extra_state"):
            return False
    return saw_tensor


def find_state_dict(obj: object) -> tuple[Mapping[str, Any], str | None]:
    """The state dict inside a loaded checkpoint, and the container key it was under.

    Returns ``(state_dict, None)`` when ``obj`` is itself one. Raises ``LookupError`` naming the
    top-level entries when no state dict can be found.
    """
    state, location = _find_state_dict(obj)
    return state, location[0] if location else None


def _find_state_dict(obj: object) -> tuple[Mapping[str, Any], tuple[str, ...]]:
    """:func:`find_state_dict`, with every key from the top down to the state dict."""
    if isinstance(obj, nn.Module):
        return unwrap(obj)[0].state_dict(), ()
    if is_state_dict(obj):
        assert isinstance(obj, Mapping)
        return obj, ()
    if not isinstance(obj, Mapping):
        raise LookupError(f"the file holds a {type(obj).__name__}, not a dict of tensors")
    for key in CONTAINER_KEYS:
        if key in obj:
            try:
                inner, below = _find_state_dict(obj[key])
            except LookupError:
                continue
            return inner, (key, *below)
    nested = [key for key, value in obj.items() if is_state_dict(value)]
    if len(nested) == 1:
        return obj[nested[0]], (str(nested[0]),)
    shown = ", ".join(repr(key) for key in list(obj)[:12])
    raise LookupError(f"no state dict among its entries ({shown})")


@dataclass(frozen=True)
class FoundWeights:
    """Where a checkpoint keeps the model's weights, and what else it holds.

    ``container`` is the top-level key the state dict sat under (None when the checkpoint is a
    state dict, or when the weights are its top-level tensors); ``top_level`` says the weights
    are the top-level tensors of a training checkpoint, beside its other entries (torchtitan
    writes the model's entries so, next to ``optimizer`` and ``train_state``); ``others`` names
    the top-level entries that are not the weights, in the checkpoint's order; ``location``
    holds the keys from the top of the checkpoint down to the state dict (``("model",)``;
    empty for a state dict on top, or top-level tensors), where each weight's place is
    ``(*location, key)``.
    """

    state: Mapping[str, Any]
    container: str | None
    top_level: bool = False
    others: list[str] = field(default_factory=list)
    location: tuple[str, ...] = ()

    @property
    def entries(self) -> set[str] | None:
        """The top-level entries that hold the weights (None: the whole checkpoint is them)."""
        if self.container is not None:
            return {self.container}
        return set(self.state) if self.top_level else None


def _top_level_tensors(obj: Mapping[Any, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}


def find_weights(obj: object) -> FoundWeights:
    """The model's weights in a loaded checkpoint: a state dict, under a container, or on top.

    A state dict under a container key wins (see :func:`find_state_dict`); where none is found,
    and no entry is a state dict, the checkpoint's top-level tensors are the weights and every
    other entry is one of ``others``. Raises ``LookupError`` naming the top-level entries
    otherwise.

    >>> found = find_weights({"weight": torch.zeros(2), "train_state": {"step": 3}})
    >>> list(found.state), found.top_level, found.others
    (['weight'], True, ['train_state'])
    """
    try:
        state, location = _find_state_dict(obj)
    except LookupError:
        if not isinstance(obj, Mapping):
            raise
        tensors = _top_level_tensors(obj)
        # Several state dicts side by side (a student and a teacher) stay a question to ask.
        if not tensors or any(is_state_dict(v) for v in obj.values()):
            raise
        others = [str(k) for k in obj if k not in tensors]
        return FoundWeights(tensors, None, top_level=True, others=others)
    container = location[0] if location else None
    if container is None or not isinstance(obj, Mapping):
        return FoundWeights(state, container, location=location)
    others = [str(k) for k in obj if k != container]
    return FoundWeights(state, container, others=others, location=location)


def _drop_wrappers(key: str) -> str:
    return ".".join(part for part in key.split(".") if part not in WRAPPER_SEGMENTS)


def _clean_key(key: str, prefixes: list[str]) -> str:
    """Replay on one key the cleaning that :func:`clean_keys` decided for all of them."""
    key = _drop_wrappers(key)
    for prefix in prefixes:
        key = key.removeprefix(prefix)
    return key


def _clean_names(keys: list[str]) -> tuple[list[str], list[str]]:
    """Cleaned keys (same order) and the prefixes removed; see :func:`clean_keys`."""
    current = [_drop_wrappers(key) for key in keys]
    found = {part for key in keys for part in key.split(".") if part in WRAPPER_SEGMENTS}
    removed = [f"{segment}." for segment in WRAPPER_SEGMENTS if segment in found]
    while current and all(key.startswith(_DP_PREFIX) for key in current):
        removed.append(_DP_PREFIX)
        current = [key[len(_DP_PREFIX) :] for key in current]
    return current, removed


def clean_keys(state_dict: Mapping[str, Any]) -> tuple[OrderedDict[str, Any], list[str]]:
    """``state_dict`` without wrapper prefixes, and the prefixes removed.

    Wrapper-owned segments (``_orig_mod.``, ``_fsdp_wrapped_module.``,
    ``_checkpoint_wrapped_module.``, ``_forward_module.``) go wherever they are; a leading
    ``module.`` is removed, as often as it is stacked, only when every key has it: a model may
    have a real submodule called ``module``.
    """
    keys, removed = _clean_names(list(state_dict))
    cleaned: OrderedDict[str, Any] = OrderedDict(zip(keys, state_dict.values(), strict=True))
    copy_metadata(state_dict, cleaned, removed)
    return cleaned, removed


def copy_metadata(
    source: Mapping[str, Any], target: OrderedDict[str, Any], prefixes: list[str]
) -> None:
    """Carry torch's per-module ``_metadata`` (versions) over, renamed like the keys."""
    metadata = getattr(source, "_metadata", None)
    if isinstance(metadata, Mapping):
        renamed: OrderedDict[str, Any] = OrderedDict()
        # Deepest names first, so the real root's entry wins over a wrapper's "" entry.
        for key in sorted(metadata, key=lambda k: -len(str(k))):
            # Metadata keys name modules without the trailing dot: "", "module.layer1".
            new_key = _clean_key(f"{key}." if key else "", prefixes).removesuffix(".")
            renamed.setdefault(new_key, metadata[key])
        target._metadata = renamed  # type: ignore[attr-defined]


class KeyMatch:
    """How the keys of a checkpoint line up with a model's."""

    def __init__(self, mapping: dict[str, str], prefixes: list[str], model_keys: list[str]):
        self.mapping = mapping  # checkpoint key -> model key
        self.prefixes = prefixes
        taken = set(mapping.values())
        self.missing = [key for key in model_keys if key not in taken]
        self.unexpected: list[str] = []


def _first_segment(keys: list[str]) -> str | None:
    heads = {key.split(".", 1)[0] for key in keys}
    if len(heads) == 1 and all("." in key for key in keys):
        return heads.pop() + "."
    return None


def match_keys(ckpt_keys: list[str], model_keys: list[str]) -> KeyMatch:
    """Map already-cleaned checkpoint keys onto a model's keys.

    A common leading segment (``model.``) is dropped while doing so matches more keys; a
    ``module.`` segment inside a key (a wrapped submodule) is dropped where that finds a key the
    model has and the checkpoint lacks.
    """
    wanted = set(model_keys)
    prefixes: list[str] = []
    keys = list(ckpt_keys)
    while (head := _first_segment(keys)) is not None:
        # "model.module.fc.weight": a framework's attribute around a DataParallel model.
        stripped, removed = _clean_names([key[len(head) :] for key in keys])
        if sum(k in wanted for k in stripped) <= sum(k in wanted for k in keys):
            break
        prefixes += [head, *removed]
        keys = stripped
    mapping: dict[str, str] = {}
    pending: list[tuple[str, str]] = []
    for original, key in zip(ckpt_keys, keys, strict=True):
        if key in wanted:
            mapping[original] = key
        else:
            pending.append((original, key))
    taken = set(mapping.values())
    unexpected: list[str] = []
    for original, key in pending:
        alt = ".".join(part for part in key.split(".") if part != _DP_PREFIX[:-1])
        if alt != key and alt in wanted and alt not in taken:
            mapping[original] = alt
            taken.add(alt)
            if ".module." not in prefixes:
                prefixes.append(".module.")
        else:
            unexpected.append(original)
    result = KeyMatch(mapping, prefixes, model_keys)
    result.unexpected = unexpected
    return result


def nearest(name: str, candidates: list[str]) -> str | None:
    """The candidate closest to ``name`` (a typo, a renamed layer), or None if none is close."""
    found = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return found[0] if found else None
