"""Which checkpoint value goes into which model tensor: matched keys, shapes, tied weights.

Nothing is read or loaded here: the plan is made from names and shapes (real tensors, or the
shape-only tensors of a folder), so a checkpoint that does not fit is refused before anything
is loaded. It carries the stored key of each tensor to read (as DCP's ``ReadItem`` carries its
storage index), so the source is asked for exactly those keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gpukit.checkpoint.keys import FoundWeights, clean_keys, find_weights, match_keys
from gpukit.checkpoint.report import LoadReport, mismatch_error
from gpukit.checkpoint.source import Source
from gpukit.errors import CheckpointError

__all__ = ["LoadPlan", "plan_load", "plan_source", "tied_groups", "weights_in"]


def _storage_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    if tensor.device.type == "meta" or tensor.untyped_storage().data_ptr() == 0:
        return None  # no storage to share
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )


def tied_groups(state: Mapping[str, Any]) -> dict[str, str]:
    """Keys whose tensor is the very same view as an earlier key's: ``{later: first}``."""
    first: dict[tuple[Any, ...], str] = {}
    tied: dict[str, str] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        storage = _storage_key(value)
        if storage is None:
            continue
        if storage in first:
            tied[key] = first[storage]
        else:
            first[storage] = key
    return tied


@dataclass
class LoadPlan:
    """What goes where: model key -> the checkpoint's value and its stored key, and the report's
    lists."""

    renamed: OrderedDict[str, Any]
    missing: list[str]
    unexpected: list[str]
    mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    prefixes: list[str]
    tied: dict[str, str]
    cleaned: OrderedDict[str, Any]
    match_prefixes: list[str]
    stored: dict[str, str]  # model key -> the stored key of the tensor it gets

    def targets(self, model_state: Mapping[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        """Each stored key to read, with the model tensors it fills (tied ones share a key)."""
        found: dict[str, list[torch.Tensor]] = {}
        for name, key in self.stored.items():
            found.setdefault(key, []).append(model_state[name])
        return found


def plan_load(
    state: Mapping[str, Any],
    model_state: Mapping[str, Any],
    file_tied: Any,
    stored_key: Callable[[str], str],
) -> LoadPlan:
    """Match a checkpoint's keys onto a model's: what loads where, and what does not fit.

    ``file_tied`` is what gk.save recorded as stored once (``{dropped: kept}``), if anything;
    ``stored_key`` gives, for a key of ``state``, the key its source stores the tensor under.
    """
    cleaned, prefixes = clean_keys(state)
    original = clean_keys({key: key for key in state})[0]  # cleaned key -> the key as stored
    match = match_keys(list(cleaned), list(model_state))
    renamed: OrderedDict[str, Any] = OrderedDict()
    stored: dict[str, str] = {}
    mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for key, value in cleaned.items():
        name = match.mapping.get(key)
        if name is None:
            continue
        wanted = model_state[name]
        mis_shaped = isinstance(value, torch.Tensor) and isinstance(wanted, torch.Tensor)
        if mis_shaped and value.shape != wanted.shape:
            mismatched[name] = (tuple(value.shape), tuple(wanted.shape))
            continue
        renamed[name] = value
        if isinstance(value, torch.Tensor) and isinstance(wanted, torch.Tensor):
            stored[name] = stored_key(original[key])
    # Tied weights: stored once. A key the model ties to a loaded one gets it through the tie;
    # one that gk.save recorded as a copy of another is filled from that one.
    tied: dict[str, str] = {}
    for later, first in tied_groups(model_state).items():
        source = first if first in renamed else later if later in renamed else None
        other = later if source == first else first
        if source is not None and other not in renamed and other not in mismatched:
            tied[other] = source
    if isinstance(file_tied, Mapping):
        for dropped, kept in file_tied.items():
            name, source = match.mapping.get(str(dropped), str(dropped)), match.mapping.get(kept)
            if (
                name in model_state
                and name not in renamed
                and source is not None
                and source in renamed
            ):
                tied.setdefault(name, source)
    for name, source in tied.items():
        renamed[name] = renamed[source]
        if source in stored:
            stored[name] = stored[source]
    return LoadPlan(
        renamed,
        [k for k in match.missing if k not in mismatched and k not in tied],
        match.unexpected,
        mismatched,
        prefixes + match.prefixes,
        tied,
        cleaned,
        match.prefixes,
        stored,
    )


def weights_in(source: Source) -> FoundWeights:
    """Where ``source`` keeps the model's weights, or a CheckpointError saying it holds none."""
    try:
        return find_weights(source.content)
    except LookupError as exc:
        raise CheckpointError(
            f"{source.path} holds no model weights: {exc}.",
            hint="Pass the file that holds the model's state_dict.",
        ) from None


def plan_source(
    source: Source,
    model_state: Mapping[str, Any],
    *,
    device: str,
    model_name: str,
    strict: bool,
) -> tuple[FoundWeights, LoadPlan, LoadReport]:
    """Plan loading ``source`` into a model whose state is ``model_state``, and report it.

    ``device`` is where the weights land (for the report), ``model_name`` the model's class.

    Raises:
        CheckpointError: the source holds no weights, or (with ``strict``) they do not fit.
    """
    found = weights_in(source)
    plan = plan_load(
        found.state,
        model_state,
        source.metadata.get("tied"),
        lambda key: source.stored_key((*found.location, key)),
    )
    report = LoadReport(
        path=source.path,
        format=source.format,
        loaded=list(plan.renamed),
        missing=plan.missing,
        unexpected=plan.unexpected,
        mismatched=plan.mismatched,
        prefixes_removed=plan.prefixes,
        source_devices=source.source_devices,
        device=device,
        container_key=found.container,
        metadata=source.metadata,
        tied=plan.tied,
        weights_at_top_level=found.top_level,
    )
    if strict and not report.ok:
        raise mismatch_error(report, model_name)
    return found, plan, report
