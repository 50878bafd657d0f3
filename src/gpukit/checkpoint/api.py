"""Checkpoints that load anywhere: save without wrapper prefixes, load into any model on any device.

>>> import gpukit as gk, torch
>>> model = torch.nn.DataParallel(torch.nn.Linear(4, 2))
>>> path = gk.save(model, "linear.safetensors")      # keys "weight", "bias": no "module."
>>> report = gk.load(torch.nn.Linear(4, 2), "linear.safetensors")
>>> report.ok
True
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from gpukit import __version__, _tree
from gpukit.checkpoint.io import SAFETENSORS, atomic_write, read, suffix_format
from gpukit.checkpoint.keys import (
    clean_keys,
    copy_metadata,
    find_state_dict,
    is_state_dict,
    match_keys,
    unwrap,
)
from gpukit.checkpoint.report import LoadReport, mismatch_error
from gpukit.checkpoint.safetensors_format import write_safetensors
from gpukit.devices import DeviceLike, device, module_device
from gpukit.errors import (
    CheckpointError,
    InvalidArgumentError,
    MixedDevicesError,
    check_bool,
)

__all__ = ["LoadReport", "clean_state_dict", "load", "save"]

METADATA_ATTRIBUTE = "_gpukit_metadata"


def clean_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A copy of ``state_dict`` without ``module.`` / ``_orig_mod.`` wrapper prefixes.

    Prefixes are removed however they are stacked, from the keys and from torch's per-module
    ``_metadata``; tensors are not copied.

    >>> clean_state_dict({"module._orig_mod.fc.weight": torch.zeros(1)}).keys()
    odict_keys(['fc.weight'])
    """
    if not isinstance(state_dict, Mapping):
        raise InvalidArgumentError(
            f"clean_state_dict takes a state dict, not a {type(state_dict).__name__}.",
            hint="Pass module.state_dict(), or the dict torch.load returned.",
        )
    return clean_keys(state_dict)[0]


@dataclass
class _Prepared:
    payload: OrderedDict[str, Any]
    wrappers: list[str] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)


def _module_state(module: nn.Module, prepared: _Prepared, label: str = "") -> OrderedDict[str, Any]:
    inner, removed = unwrap(module)
    prepared.wrappers.extend(f"{label}{name}" for name in removed)
    cleaned, prefixes = clean_keys(inner.state_dict())  # compiled submodules: "_orig_mod." inside
    prepared.prefixes.extend(p for p in prefixes if p not in prepared.prefixes)
    return cleaned


def _prepare(obj: object) -> _Prepared:
    prepared = _Prepared(OrderedDict())
    if isinstance(obj, nn.Module):
        prepared.payload = _module_state(obj, prepared)
        return prepared
    if not isinstance(obj, Mapping):
        raise InvalidArgumentError(
            f"gk.save takes a module, a state dict, or a dict of things to save, not a "
            f"{type(obj).__name__}.",
            hint='Wrap it in a dict, for example gk.save({"model": model, "step": step}, path).',
        )
    if is_state_dict(obj):
        prepared.payload, prepared.prefixes = clean_keys(obj)
        return prepared
    for key, value in obj.items():
        if isinstance(value, nn.Module):
            value = _module_state(value, prepared, f"{key}: ")
        elif is_state_dict(value):
            value, prefixes = clean_keys(value)
            prepared.prefixes.extend(p for p in prefixes if p not in prepared.prefixes)
        elif not isinstance(value, torch.Tensor) and callable(getattr(value, "state_dict", None)):
            value = value.state_dict()  # optimizers, schedulers, GradScaler: their state only
        prepared.payload[key] = value
    return prepared


def _devices(obj: object, found: set[str]) -> set[str]:
    """Add the device of every tensor in ``obj`` (any nesting tree_map walks) to ``found``."""
    found.update(str(t.device) for _, t in _tree.leaves_with_paths(obj, torch.Tensor))
    return found


def _user_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    try:
        return dict(json.loads(json.dumps(dict(metadata))))
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"gk.save metadata must be JSON-serialisable (strings, numbers, lists, dicts): {exc}.",
            hint="Convert other values to strings first.",
        ) from None


def _write_safetensors(path: Path, prepared: _Prepared, info: dict[str, Any]) -> None:
    payload = prepared.payload
    others = [k for k, v in payload.items() if not isinstance(v, torch.Tensor)]
    if others:
        shown = ", ".join(repr(k) for k in others[:6]) + (" ..." if len(others) > 6 else "")
        raise CheckpointError(
            f"Cannot save {path.name} as safetensors: the format holds only named tensors, and "
            f"this checkpoint also has {shown}.",
            hint="Save it as .pt/.pth instead, or save only the model's weights to .safetensors.",
        )
    header = {"format": "pt", "gpukit": json.dumps(info)}
    atomic_write(path, lambda handle, _: write_safetensors(handle, payload, header))


def save(obj: object, path: str | Path, *, metadata: Mapping[str, Any] | None = None) -> Path:
    """Save a module, a state dict, or a dict of things, atomically; returns the path.

    Wrappers (``nn.DataParallel``, DDP, ``gk.DataParallel``, ``torch.compile``) are removed
    first, so keys never carry ``module.`` or ``_orig_mod.``; optimizers and schedulers in a dict
    are saved as their state dicts. The format follows the suffix: ``.safetensors`` (weights
    only) or ``.pt`` / ``.pth``. The gpukit and torch versions, the wrappers removed, the devices
    the tensors were on and ``metadata`` (JSON-serialisable) are recorded with it.

    >>> save({"model": model, "optimizer": opt, "epoch": 3}, "run/last.pt")  # doctest: +SKIP
    """
    target = Path(path)
    fmt = suffix_format(target)
    prepared = _prepare(obj)
    info: dict[str, Any] = {
        "gpukit_version": __version__,
        "torch_version": str(torch.__version__),
        "format": fmt,
        "wrappers_removed": prepared.wrappers,
        "prefixes_removed": prepared.prefixes,
        "devices": sorted(_devices(prepared.payload, set())),
        "metadata": _user_metadata(metadata),
    }
    if fmt == SAFETENSORS:
        _write_safetensors(target, prepared, info)
    else:
        payload = prepared.payload
        setattr(payload, METADATA_ATTRIBUTE, info)  # torch.save pickles an OrderedDict's attributes
        atomic_write(target, lambda handle, _: torch.save(payload, handle))
    return target


def _target(model: nn.Module, map_location: DeviceLike | Literal["auto"]) -> torch.device:
    if map_location != "auto":
        return device(map_location)
    try:
        return module_device(model)
    except MixedDevicesError:
        # load_state_dict copies each tensor onto its parameter's device anyway.
        return torch.device("cpu")


def _extras(content: object, container: str | None) -> dict[str, Any]:
    if container is None or not isinstance(content, Mapping):
        return {}
    return {str(k): v for k, v in content.items() if k != container}


def load(
    model: nn.Module,
    path: str | Path,
    *,
    map_location: DeviceLike | Literal["auto"] = "auto",
    strict: bool = True,
    trust: bool = False,
) -> LoadReport:
    """Load a checkpoint into ``model``, whatever wrapped it and wherever it was saved.

    Reads ``.safetensors`` and torch files, finds the weights in common containers
    (``"state_dict"``, ``"model"``, ...), removes ``module.`` / ``_orig_mod.`` prefixes and a
    leading ``model.`` when that is what makes the keys match, and maps tensors onto the
    model's device (``map_location="auto"``). Pickled code is refused unless ``trust=True``.
    With ``strict=True`` any missing, unexpected or mis-shaped key raises a
    :class:`~gpukit.errors.CheckpointError` naming them and their nearest matches; otherwise the
    keys that fit are loaded and the returned :class:`LoadReport` lists the rest.

    >>> report = load(model, "run/last.pt")       # doctest: +SKIP
    >>> optimizer.load_state_dict(report.extras["optimizer"])  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            f"gk.load loads into a model (an nn.Module), and was given a {type(model).__name__}.",
            hint="Call gk.load(model, path): the model comes first, the file second.",
        )
    check_bool("strict", strict)
    check_bool("trust", trust)
    inner, _ = unwrap(model)
    target = _target(inner, map_location)
    raw = read(Path(path), target=target, trust=trust)
    try:
        state, container = find_state_dict(raw.content)
    except LookupError as exc:
        raise CheckpointError(
            f"{raw.path} holds no model weights: {exc}.",
            hint="Pass the file that holds the model's state_dict.",
        ) from None
    cleaned, prefixes = clean_keys(state)
    model_state = inner.state_dict()
    match = match_keys(list(cleaned), list(model_state))
    renamed: OrderedDict[str, Any] = OrderedDict()
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
    report = LoadReport(
        path=raw.path,
        format=raw.format,
        loaded=list(renamed),
        missing=[k for k in match.missing if k not in mismatched],
        unexpected=match.unexpected,
        mismatched=mismatched,
        prefixes_removed=prefixes + match.prefixes,
        source_devices=raw.source_devices,
        device=str(target),
        container_key=container,
        metadata=raw.metadata,
        extras=_extras(raw.content, container),
    )
    if strict and not report.ok:
        raise mismatch_error(report, type(inner).__name__)
    # torch's per-module versions, renamed like the keys (BatchNorm and others consult them).
    copy_metadata(cleaned, renamed, [p for p in match.prefixes if not p.startswith(".")])
    inner.load_state_dict(renamed, strict=strict)
    return report
