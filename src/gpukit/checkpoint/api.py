"""Checkpoints that load anywhere: save without wrapper prefixes, load into any model on any device.

>>> import gpukit as gk, torch
>>> model = torch.nn.DataParallel(torch.nn.Linear(4, 2))
>>> path = gk.save(model, "linear.safetensors")      # keys "weight", "bias": no "module."
>>> report = gk.load(torch.nn.Linear(4, 2), "linear.safetensors")
>>> report.ok
True
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from gpukit import __version__, _tree
from gpukit.checkpoint.atomic import atomic_folder, atomic_write, write_durable
from gpukit.checkpoint.dtensor import is_sharded
from gpukit.checkpoint.keys import (
    clean_keys,
    copy_metadata,
    is_state_dict,
    unwrap,
)
from gpukit.checkpoint.layout import open_source
from gpukit.checkpoint.paths import (
    check_output_file,
    check_output_folder,
    make_parents,
    parents_to_make,
)
from gpukit.checkpoint.plan import plan_source, tied_groups
from gpukit.checkpoint.report import LoadReport
from gpukit.checkpoint.safetensors_format import write_safetensors
from gpukit.checkpoint.sharded import SAFETENSORS_INDEX, write_shards
from gpukit.checkpoint.sharded_model import load_sharded, save_sharded
from gpukit.checkpoint.single_file import SAFETENSORS, suffix_format
from gpukit.checkpoint.source import StoredObject
from gpukit.devices import DeviceLike, device, module_device
from gpukit.errors import (
    CheckpointError,
    InvalidArgumentError,
    MixedDevicesError,
    check_bool,
)
from gpukit.sizes import DEFAULT_SHARD_SIZE, parse_shard_size

__all__ = [
    "SaveTarget",
    "check_save_target",
    "clean_state_dict",
    "load",
    "save",
    "save_layout",
]

METADATA_ATTRIBUTE = "_gpukit_metadata"


def clean_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A copy of ``state_dict`` without ``module.`` / ``_orig_mod.`` wrapper prefixes.

    Prefixes are removed however they are stacked, from the keys and from torch's per-module
    ``_metadata``; tensors are not copied.

    >>> clean_state_dict({"module._orig_mod.fc.weight": torch.zeros(1)}).keys()
    odict_keys(['fc.weight'])

    Args:
        state_dict: the state dict whose keys may carry wrapper prefixes.
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
    dtype: torch.dtype | None = None  # the weights' export dtype, if one was asked for
    _cast: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)

    def weights(self, state: OrderedDict[str, Any]) -> OrderedDict[str, Any]:
        """``state`` with its floating-point tensors in the export dtype (ties kept)."""
        if self.dtype is None:
            return state
        out: OrderedDict[str, Any] = OrderedDict()
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                # Tied weights are one storage under two keys: cast once, so they stay tied.
                same: tuple[Any, ...] = (
                    value.device,
                    value.data_ptr(),
                    value.shape,
                    value.stride(),
                )
                if value.data_ptr() == 0:  # no storage (meta, empty): nothing to share
                    same = (id(value),)
                if same not in self._cast:
                    self._cast[same] = value.detach().to(self.dtype)
                value = self._cast[same]
            out[key] = value
        return out


_EXPORT_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _export_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The export dtype ``dtype=`` names, or an InvalidArgumentError."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in _EXPORT_DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype in _EXPORT_DTYPES:
        return _EXPORT_DTYPES[dtype]
    raise InvalidArgumentError(
        f"gk.save got dtype={dtype!r}, which is not a floating-point dtype to export weights in.",
        hint="Pass torch.bfloat16, torch.float16 or torch.float32 (or 'bf16', 'fp16', 'fp32'), "
        "or leave it out to keep the weights as they are (float32 under mixed precision).",
    )


def _module_state(module: nn.Module, prepared: _Prepared, label: str = "") -> OrderedDict[str, Any]:
    inner, removed = unwrap(module)
    prepared.wrappers.extend(f"{label}{name}" for name in removed)
    cleaned, prefixes = clean_keys(inner.state_dict())  # compiled submodules: "_orig_mod." inside
    prepared.prefixes.extend(p for p in prefixes if p not in prepared.prefixes)
    return prepared.weights(cleaned)


def _prepare(obj: object, dtype: torch.dtype | None = None) -> _Prepared:
    prepared = _Prepared(OrderedDict(), dtype=dtype)
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
        cleaned, prepared.prefixes = clean_keys(obj)
        prepared.payload = prepared.weights(cleaned)
        return prepared
    for key, value in obj.items():
        if isinstance(value, nn.Module):
            value = _module_state(value, prepared, f"{key}: ")
        elif is_state_dict(value):
            value, prefixes = clean_keys(value)
            value = prepared.weights(value)
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


def _tensors_only(path: Path, prepared: _Prepared) -> OrderedDict[str, torch.Tensor]:
    payload = prepared.payload
    others = [k for k, v in payload.items() if not isinstance(v, torch.Tensor)]
    if others:
        shown = ", ".join(repr(k) for k in others[:6]) + (" ..." if len(others) > 6 else "")
        raise CheckpointError(
            f"Cannot save {path.name} as safetensors: the format holds only named tensors, and "
            f"this checkpoint also has {shown}.",
            hint="Save it as .pt/.pth instead, or save only the model's weights to .safetensors "
            "or a sharded folder.",
        )
    return OrderedDict(payload)


def _untie(tensors: OrderedDict[str, torch.Tensor], info: dict[str, Any]) -> None:
    """Store tied weights once (safetensors cannot share); gk.load ties them back."""
    tied = tied_groups(tensors)
    for later in tied:
        del tensors[later]
    info["tied"] = tied


def is_layout_file(name: str) -> bool:
    """A file name that gk.save's folder layout writes (and may replace)."""
    return name == SAFETENSORS_INDEX or _SHARD_NAME.match(name) is not None


_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
SHARDED = "sharded safetensors"


@dataclass(frozen=True)
class SaveTarget:
    """Where and how :func:`save` writes, checked before any work.

    ``format`` is ``"safetensors"``, ``"torch"`` (one file) or ``"sharded safetensors"`` (a
    folder of shards of at most ``shard_limit`` bytes); ``make_parents`` says the missing
    folders above ``path`` will be created.
    """

    path: Path
    format: str
    shard_limit: int | None
    make_parents: bool


def _names_a_file(path: Path) -> bool:
    try:
        suffix_format(path)
    except InvalidArgumentError:
        return False
    return True


def save_layout(
    path: Path, max_shard_size: int | str | None, *, option: str = "max_shard_size"
) -> tuple[str, int | None]:
    """What :func:`save` writes at ``path``, from its name alone: gpukit's one suffix rule.

    A checkpoint file's suffix, compared in any case (``.safetensors``; ``.pt``, ``.pth``,
    ``.bin``, ``.ckpt``, ``.tar`` for torch), names one file: ``("safetensors", None)`` or
    ``("torch", None)``. A path without a suffix, or any other path with ``max_shard_size``,
    is a folder: ``("sharded safetensors", limit)``, the limit in bytes, ``None`` where no size
    was asked (a plain model's folder then has shards of the default size; a sharded model's
    is a DCP folder). A plain model and a sharded one read a path alike; the file system is
    not looked at, so every rank of a job decides the same.

    >>> save_layout(Path("w.PT"), None)
    ('torch', None)
    >>> save_layout(Path("run/weights"), "1KB")
    ('sharded safetensors', 1000)

    Args:
        path: where the checkpoint goes.
        max_shard_size: the largest shard of a folder (bytes, or ``"2GB"``...), or ``None``.
        option: the argument's name, as the messages call it (``--max-shard-size``...).

    Raises:
        InvalidArgumentError: a file's suffix with ``max_shard_size``, another suffix without
            it, or a size that is not one.
    """
    if max_shard_size is not None and _names_a_file(path):
        raise InvalidArgumentError(
            f"{path.name} names one {suffix_format(path)} file (by its suffix "
            f"{path.suffix}), and {option} asks for a folder of shards.",
            hint=f"Drop {option} to write one file, or name the folder without a suffix "
            f"(for example {path.with_suffix('').name}).",
        )
    if max_shard_size is not None:
        return SHARDED, parse_shard_size(max_shard_size, option=option)
    if path.suffix == "":
        return SHARDED, None
    return suffix_format(path), None  # refuses a suffix it does not know


def check_save_target(
    path: Path, max_shard_size: int | str | None, *, option: str = "max_shard_size"
) -> SaveTarget:
    """Check where :func:`save` would write ``path``, and in which layout, before any work.

    The layout is :func:`save_layout`'s (a folder's shards default to 5GB here); the path is
    then checked: a file's folder must be writable, a folder may be replaced only if it holds
    nothing but gk.save's own layout. Missing parent folders are made by :func:`save` where the
    nearest existing one is writable.

    Args:
        path: where the checkpoint goes.
        max_shard_size: the largest shard of a folder, or ``None``.
        option: the argument's name, as the messages call it.

    Raises:
        InvalidArgumentError: :func:`save_layout` refused the path or the size.
        CheckpointError: the path cannot be written.
    """
    fmt, limit = save_layout(path, max_shard_size, option=option)
    sharded = fmt == SHARDED
    if sharded and limit is None:
        limit = parse_shard_size(DEFAULT_SHARD_SIZE, option=option)
    make = parents_to_make(path)
    if not make and sharded:
        check_output_folder(path, is_layout_file)
    elif not make:
        check_output_file(path)
    return SaveTarget(path, fmt, limit, make)


def save(
    obj: object,
    path: str | Path,
    *,
    metadata: Mapping[str, Any] | None = None,
    max_shard_size: int | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> Path:
    """Save a module, a state dict, or a dict of things, atomically; returns the path.

    Wrappers (``nn.DataParallel``, DDP, ``gk.DataParallel``, ``torch.compile``) are removed
    first, so keys never carry ``module.`` or ``_orig_mod.``; optimizers and schedulers in a dict
    are saved as their state dicts. The path picks the layout (:func:`save_layout`, suffixes
    compared in any case): ``.safetensors`` (weights only) or ``.pt`` / ``.pth`` / ``.bin`` /
    ``.ckpt`` / ``.tar`` is one file (and ``max_shard_size`` with such a path is refused);
    another suffix is refused; a path without a suffix, or with ``max_shard_size`` (bytes, or
    ``"2GB"``, ``"1.5G"``, ``"500MiB"`` as :func:`gpukit.sizes.parse_size` reads them; 5GB by
    default), is a folder in Hugging Face's sharded safetensors layout
    (``model-00001-of-00002.safetensors``... and ``model.safetensors.index.json``), which
    Hugging Face's loaders read. Missing parent folders are created (as ``mkdir -p`` does)
    when the nearest existing one is writable. A folder is written
    as a whole: a crash leaves the old folder or the new one, and an existing folder is
    replaced only if it holds nothing but such a layout. Tied weights are stored once in
    safetensors and come back tied with :func:`load`. The gpukit and torch versions, the
    wrappers removed, the devices the tensors were on and ``metadata`` (JSON-serialisable) are
    recorded with it.

    >>> save({"model": model, "optimizer": opt, "epoch": 3}, "run/last.pt")  # doctest: +SKIP
    >>> save(model, "run/weights", max_shard_size="2GB")  # doctest: +SKIP

    Weights are saved as they are: under mixed precision that is float32, the master weights.
    ``dtype`` (``torch.bfloat16``, ``"fp16"``...) exports the models' and state dicts'
    floating-point tensors in that dtype instead (an optimizer's state is kept as it is);
    the dtype is recorded with the rest, and :func:`load` casts back to the model's dtype.

    A model sharded over processes (FSDP2) is saved by every process at once, as
    :mod:`gpukit.checkpoint.sharded_model` describes: call ``save(model, path)`` on every rank
    (one file is still written once, by rank 0). The path means what it means for a plain
    model: a file's suffix is one file of the full weights, a path without a suffix a folder
    (a DCP checkpoint there, each process writing its own part, unless ``max_shard_size``).

    Args:
        obj: a module, a state dict, or a dict of things (models, optimizers, plain data).
        path: where to write; its suffix picks the layout (see above).
        metadata: plain data stored with the weights (safetensors: strings), or None.
        max_shard_size: the largest shard of a folder, bytes or a size (``"2GB"``); None: 5GB.
        dtype: a floating dtype to save the floating tensors in (``"bf16"``), or None.

    Raises:
        InvalidArgumentError: ``obj`` is not something to save, ``metadata`` is not JSON,
            ``dtype`` is not a floating-point dtype (or is asked of a sharded model), or the
            path's suffix is not one :func:`save_layout` knows.
        CheckpointError: the path cannot be written (nothing half-written is left), or a
            sharded model's save was not called on every rank (raised on those that called).
    """
    export = _export_dtype(dtype)
    if is_sharded(obj) and export is not None:
        raise InvalidArgumentError(
            "gk.save got dtype= for a model sharded over processes, which it saves as it is.",
            hint="Save it without dtype=, then load it into one unsharded model and save that "
            "with dtype=.",
        )
    if is_sharded(obj):  # every rank writes its own part: checkpoint/sharded_model.py
        layout, limit = save_layout(Path(path), max_shard_size)  # as for a plain model
        return save_sharded(
            obj,
            Path(path),
            layout=layout,
            shard_limit=limit,
            metadata=_user_metadata(metadata),
            save_file=save,
        )
    planned = check_save_target(Path(path), max_shard_size)
    target, fmt, sharded = planned.path, planned.format, planned.format == SHARDED
    prepared = _prepare(obj, export)
    info: dict[str, Any] = {
        "gpukit_version": __version__,
        "torch_version": str(torch.__version__),
        "format": fmt,
        "wrappers_removed": prepared.wrappers,
        "prefixes_removed": prepared.prefixes,
        "devices": sorted(_devices(prepared.payload, set())),
        "metadata": _user_metadata(metadata),
    }
    if export is not None:
        info["dtype"] = str(export).removeprefix("torch.")
    write: Callable[[], None]
    if sharded or fmt == SAFETENSORS:
        tensors = _tensors_only(target, prepared)
        _untie(tensors, info)
        header = {"format": "pt", "gpukit": json.dumps(info)}
        limit = planned.shard_limit
        if limit is not None:
            write = partial(
                atomic_folder,
                target,
                lambda folder: write_shards(folder, tensors, header, limit, write_durable),
            )
        else:
            write = partial(
                atomic_write, target, lambda handle, _: write_safetensors(handle, tensors, header)
            )
    else:
        payload = prepared.payload
        setattr(payload, METADATA_ATTRIBUTE, info)  # torch.save pickles an OrderedDict's attributes
        write = partial(atomic_write, target, lambda handle, _: torch.save(payload, handle))
    if planned.make_parents:  # only now: a refused object leaves no new folder behind
        make_parents(target)
    write()
    return target


def _target(model: nn.Module, map_location: DeviceLike | Literal["auto"]) -> torch.device:
    if map_location != "auto":
        return device(map_location)
    try:
        return module_device(model)
    except MixedDevicesError:
        # load_state_dict copies each tensor onto its parameter's device anyway.
        return torch.device("cpu")


def load(
    model: nn.Module,
    path: str | Path,
    *,
    map_location: DeviceLike | Literal["auto"] = "auto",
    strict: bool = True,
    trust: bool = False,
) -> LoadReport:
    """Load a checkpoint into ``model``, whatever wrapped it and wherever it was saved.

    ``path`` is a checkpoint file (``.safetensors`` or torch, recognised by content), a sharded
    folder or its index file (Hugging Face's layout, safetensors or ``.bin`` shards), a
    torch.distributed.checkpoint (DCP) folder, or a folder written by accelerate's
    ``Accelerator.save_state`` (the first model's file is the weights; the optimizer, scheduler
    and other files go into ``report.extras``, and a pickle that needs ``trust=True`` is left
    unread and named in ``report.unread``). The weights are found in common containers
    (``"state_dict"``, ``"model"``, ...) or, where no entry is a state dict, are the top-level
    tensors beside the other entries (torchtitan's layout); wrapper segments (``module.``,
    ``_orig_mod.``, ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``,
    ``_forward_module.``) and a
    leading ``model.`` are removed when that is what makes the keys match, and tensors are
    mapped onto the model's device (``map_location="auto"``). Folders are read one shard at a
    time straight into the model's tensors, so the whole checkpoint is never in memory at once.
    Pickled code is refused unless ``trust=True`` (a DCP folder needs no trust: its metadata is
    read with an unpickler that runs no code). With ``strict=True`` any missing, unexpected or
    mis-shaped key raises a :class:`~gpukit.errors.CheckpointError` naming them and their nearest
    matches, before anything is loaded; otherwise the keys that fit are loaded and the returned
    :class:`LoadReport` lists the rest. Weights the model ties together are loaded once.

    >>> report = load(model, "run/last.pt")       # doctest: +SKIP
    >>> optimizer.load_state_dict(report.extras["optimizer"])  # doctest: +SKIP

    Args:
        model: the model to load into, wrapped or not.
        path: the checkpoint: a file, a sharded folder or its index, a DCP folder, an accelerate
            ``save_state`` folder, or a training state's save folder.
        map_location: where tensors are read to; ``"auto"``: the model's device.
        strict: whether missing and unexpected keys are an error (False: reported).
        trust: allow a pickle that runs code to be read (only for files you made).
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            f"gk.load loads into a model (an nn.Module), and was given a {type(model).__name__}.",
            hint="Call gk.load(model, path): the model comes first, the file second.",
        )
    check_bool("strict", strict)
    check_bool("trust", trust)
    if is_sharded(model):  # every rank reads its own part: checkpoint/sharded_model.py
        return load_sharded(model, Path(path), strict=strict, trust=trust)
    inner, _ = unwrap(model)
    target = _target(inner, map_location)
    source = open_source(Path(path), target=target, trust=trust)
    model_state = inner.state_dict()
    found, plan, report = plan_source(
        source, model_state, device=str(target), model_name=type(inner).__name__, strict=strict
    )
    if found.others:
        # The rest of a training state (optimizer, step...); read first, so that a refused
        # pickle among them leaves the model untouched.
        extras, unread = source.read_extras(found.others, trust=trust)
        if target.type != "cpu":
            from gpukit.transfer import to_device

            extras = to_device(extras, target)
        report = dataclasses.replace(report, extras=extras, unread=unread)
    source.read_into(plan.targets(model_state), trust=trust)
    # The model's own tensors, now filled (copying them onto themselves costs nothing), and the
    # entries that are not tensors (a module's extra state): load_state_dict then runs the
    # modules' own loading code, with torch's per-module versions renamed like the keys.
    loaded: OrderedDict[str, Any] = OrderedDict(
        (name, model_state[name] if name in plan.stored else value)
        for name, value in plan.renamed.items()
        if not isinstance(value, StoredObject)
    )
    copy_metadata(plan.cleaned, loaded, [p for p in plan.match_prefixes if not p.startswith(".")])
    inner.load_state_dict(loaded, strict=strict)
    return report
