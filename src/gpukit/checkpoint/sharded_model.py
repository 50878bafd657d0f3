"""Checkpoints of a model sharded over processes (FSDP2: its parameters are DTensors).

:func:`~gpukit.save` and :func:`~gpukit.load` hand a sharded model to this module, which every
process of the group calls at the same time:

- ``save(model, "ckpt")`` writes a torch.distributed.checkpoint (DCP) folder in which each rank
  writes only its own shards (``torch.distributed.checkpoint.save``); a dict of a sharded model,
  its optimizers and plain values is saved the same way (``get_state_dict``).
- ``save(model, "weights", max_shard_size=...)`` exports the full weights in Hugging Face's
  sharded safetensors layout: the tensors are gathered one at a time (``full_tensor()``) and
  streamed into the shard files by rank 0, so no rank holds more than one full tensor.
- ``save(model, "model.safetensors")`` (or ``.pt``) gathers the full weights on rank 0's CPU
  (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``) and writes one file.
- ``load(model, dcp_folder)`` reads each rank's own part through DCP's planner, whatever number
  of processes saved it (resharding); ``load(model, file_or_hf_folder)`` reads the full weights
  on rank 0 (CPU) and scatters them one tensor at a time (``set_model_state_dict`` with
  ``broadcast_from_rank0``).

The path means what it means for a plain model (:func:`gpukit.checkpoint.api.save_layout`, the
one suffix rule, decided before this module is reached): a checkpoint file's suffix, in any case
(``.pt``, ``.PT``, ``.safetensors``...), is one file of the full weights; a path without a suffix
is a folder (DCP, or Hugging Face's layout with ``max_shard_size``); another suffix is refused.

Every rank must call :func:`~gpukit.save` and :func:`~gpukit.load` of a sharded model, as any
collective (each rank writes or reads its own part; one file is still written once, by rank 0).
So the ranks first meet in a gloo group of their own (:func:`join_group`), in a monitored
barrier: a call on rank 0 alone (``if dist.is_main(): gk.save(model, ...)``, the unsharded
habit) fails within :data:`JOIN_TIMEOUT` with a :class:`~gpukit.errors.CheckpointError` that
says to call it on every rank, instead of hanging or crashing in a collective the other ranks
never join. Errors on rank 0 (a bad path, a mismatched checkpoint) reach every rank as the same
error, so no rank waits for a collective that the others left.
"""

from __future__ import annotations

import json
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, TypeVar
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from torch import nn

from gpukit import __version__
from gpukit._agree import first_error, from_rank_0
from gpukit.checkpoint.atomic import atomic_folder, write_durable
from gpukit.checkpoint.dcp import METADATA_NAME, is_dcp_folder, write_dcp
from gpukit.checkpoint.dtensor import dtensor_type as _dtensor_type
from gpukit.checkpoint.dtensor import models_in as _modules
from gpukit.checkpoint.keys import clean_keys, unwrap
from gpukit.checkpoint.layout import open_source
from gpukit.checkpoint.paths import check_output_folder, make_parents, parents_to_make
from gpukit.checkpoint.plan import LoadPlan, plan_source
from gpukit.checkpoint.report import LoadReport
from gpukit.checkpoint.safetensors_format import DTYPES
from gpukit.checkpoint.sharded import SAFETENSORS_INDEX, plan_shards, shard_names
from gpukit.checkpoint.source import Source
from gpukit.errors import (
    CheckpointError,
    DistributedError,
    GpukitError,
    InvalidArgumentError,
)
from gpukit.untrusted import printable

__all__ = ["JOIN_TIMEOUT", "join_group", "load_sharded", "save_sharded"]

T = TypeVar("T")
_DCP_DATA = re.compile(r"^__\d+_\d+\.distcp$")
_HF_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_FOLDER = "sharded safetensors"  # save_layout's name for a folder

JOIN_TIMEOUT = timedelta(seconds=60)
"""How long rank 0 waits for every other rank to call gk.save / gk.load of a sharded model.

Long enough for ranks that leave the same training step at different times, short enough that
a call on rank 0 alone fails with an error that says what to do instead of hanging."""


_JOIN_GROUPS: WeakKeyDictionary[nn.Module, tuple[Any, Any]] = WeakKeyDictionary()


def join_group(model: nn.Module, *, timeout: timedelta | None = None) -> Any:
    """The gloo group in which every rank meets before saving or loading ``model``; made once.

    Making it is a collective of the default group, so the first call must be made by every
    rank at the same time: :func:`gpukit.train.shard.shard` calls this as it shards, so that
    gk.save and gk.load of a model sharded by gpukit only meet in it. A model sharded by other
    code gets its group at its first gk.save or gk.load (a call on rank 0 alone then fails
    within :data:`JOIN_TIMEOUT`, as later ones do, and leaves the group numbering of this
    process ahead of the others: restart the job after fixing the script).

    Args:
        model: the sharded model (wrappers are looked through).
        timeout: how long the group's operations wait (torch's default when ``None``).

    Raises:
        DistributedError: the other ranks did not make the group with this one in time.
    """
    world = dist.group.WORLD
    key = unwrap(model)[0]
    found = _JOIN_GROUPS.get(key)
    if found is not None and found[0] is world:
        return found[1]
    try:
        group = dist.new_group(backend="gloo", timeout=timeout)
    except RuntimeError as exc:  # the store's wait for the other ranks timed out
        seen = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DistributedError(
            f"rank {dist.get_rank()} made the group that gk.save and gk.load of a sharded "
            f"model meet in, and the other ranks did not ({seen}).",
            hint="Shard the model, and save or load it, on every rank at the same time.",
        ) from None
    _JOIN_GROUPS[key] = (world, group)
    return group


_EACH_RANK = {
    "gk.save": "it writes once",
    "gk.load": "each rank reads its own part",
}


def _join(obj: object, what: str) -> None:
    """Meet every rank in ``obj``'s join group, or raise on the ranks that came (no hang)."""
    if dist.get_world_size() == 1:
        return
    models = _modules(obj)
    try:
        group = join_group(models[0], timeout=JOIN_TIMEOUT)
        dist.monitored_barrier(group, timeout=JOIN_TIMEOUT, wait_all_ranks=True)
    except RuntimeError as exc:  # torch's DistError and gloo's timeouts and closed connections
        seen = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(
            f"{what} of a sharded model was not called by every rank: rank {dist.get_rank()} "
            f"did not meet the others in it within {JOIN_TIMEOUT.total_seconds():g} s "
            f"({printable(seen) or '?'}).",
            hint=f"Call {what}(model, path) on every rank with a sharded model "
            f"({_EACH_RANK[what]}), not under `if dist.is_main():`.",
        ) from None


def _agree(fn: Callable[[], T]) -> T | None:
    """Run ``fn`` on rank 0 and give every rank its error (raised) or its result."""
    mine: tuple[str, Any] | None = None
    if dist.get_rank() == 0:
        try:
            mine = ("ok", fn())
        except GpukitError as exc:
            mine = ("error", exc)
    outcome = from_rank_0(mine)
    assert outcome is not None
    if outcome[0] == "error":
        raise outcome[1]
    result: T = outcome[1]
    return result


def _replaceable(name: str) -> bool:
    return name in (METADATA_NAME, SAFETENSORS_INDEX) or bool(
        _DCP_DATA.match(name) or _HF_SHARD.match(name)
    )


def _check_folder(path: Path) -> None:
    if parents_to_make(path):
        make_parents(path)
    else:
        check_output_folder(path, _replaceable)


def _info(fmt: str, metadata: Mapping[str, Any], devices: set[str]) -> dict[str, Any]:
    return {
        "gpukit_version": __version__,
        "torch_version": str(torch.__version__),
        "format": fmt,
        "wrappers_removed": [],
        "prefixes_removed": [],
        "devices": sorted(devices),
        "metadata": dict(metadata),
        "world_size": dist.get_world_size(),
    }


def _model_state(model: nn.Module) -> OrderedDict[str, Any]:
    inner, _ = unwrap(model)
    return clean_keys(inner.state_dict())[0]


def _attempt(
    fill: Callable[[Path | None], None], tmp: Path | None, path: Path
) -> GpukitError | None:
    """Run ``fill(tmp)``; the typed error it met, if any (an OSError turned into one)."""
    try:
        fill(tmp)
    except GpukitError as exc:
        return exc
    except OSError as exc:
        return CheckpointError(
            f"Cannot save {path}: {exc.strerror or exc}.", hint="Check the path and space."
        )
    return None


def _in_folder(path: Path, fill: Callable[[Path | None], None]) -> None:
    """Build the folder ``path`` with every rank's ``fill(tmp)``, put in place by rank 0.

    Rank 0 makes the temporary folder and tells the others its name; a failure on rank 0
    before that tells them ``None`` (``fill(None)`` must then only join the collectives).
    Once every rank has filled its part the ranks meet: the folder is put in place only if
    every rank's part is written, and every rank raises the same error otherwise.
    """
    if dist.get_rank() != 0:
        named = from_rank_0(None)
        tmp = Path(str(named)) if named is not None else None
        first_error(_attempt(fill, tmp, path))
        failure = from_rank_0(None)
    else:
        failure = from_rank_0(_build_on_rank_0(path, fill))
    if failure is not None:
        raise failure


def _build_on_rank_0(path: Path, fill: Callable[[Path | None], None]) -> GpukitError | None:
    """Rank 0's side of :func:`_in_folder`: check, build, meet, put in place; its error."""
    sent = False

    def fill_here(tmp: Path) -> None:
        nonlocal sent
        from_rank_0(str(tmp))
        sent = True
        failure = first_error(_attempt(fill, tmp, path))
        if failure is not None:
            raise failure  # atomic_folder removes the temporary folder

    failure: GpukitError | None = None
    try:
        _check_folder(path)
        atomic_folder(path, fill_here)
    except GpukitError as exc:
        failure = exc
    except OSError as exc:
        failure = CheckpointError(
            f"Cannot save {path}: {exc.strerror or exc}.", hint="Check the path and space."
        )
    if not sent:  # refused before the folder existed: join the others' collectives
        from_rank_0(None)
        first_error(_attempt(fill, None, path))
    return failure


def _dcp_state(obj: object) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if isinstance(obj, nn.Module):
        return dict(get_model_state_dict(obj))
    assert isinstance(obj, Mapping)
    models = _modules(obj)  # one: save_sharded checked it
    state: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, nn.Module):
            state[str(key)] = dict(get_model_state_dict(value))
        elif isinstance(value, torch.optim.Optimizer):
            state[str(key)] = get_optimizer_state_dict(models[0], value)
        elif not isinstance(value, torch.Tensor) and callable(getattr(value, "state_dict", None)):
            state[str(key)] = value.state_dict()
        else:
            state[str(key)] = value
    return state


def _save_dcp(obj: object, path: Path) -> None:
    state = _dcp_state(obj)

    def fill(tmp: Path | None) -> None:
        if tmp is not None:  # gpukit's one DCP writer, as for a training state's sharded part
            write_dcp(tmp, state, target=path)

    _in_folder(path, fill)


def _header(
    tensors: Mapping[str, Any], metadata: Mapping[str, str]
) -> tuple[bytes, dict[str, int]]:
    """The safetensors header for ``tensors`` (shapes and dtypes only) and each one's size."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    sizes: dict[str, int] = {}
    offset = 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        sizes[key] = size
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded, sizes


def _full(tensor: Any) -> torch.Tensor:
    """The whole tensor on the CPU: gathered from every rank (a collective) when sharded."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        tensor = tensor.full_tensor()  # type: ignore[attr-defined]
    return tensor.detach().to("cpu").contiguous()  # type: ignore[no-any-return]


def _export(model: nn.Module, path: Path, limit: int, metadata: Mapping[str, Any]) -> None:
    state = _model_state(model)
    refused = [k for k, t in state.items() if getattr(t, "dtype", None) not in DTYPES]
    if refused:  # every rank sees the same state: each refuses on its own, before any gather
        raise CheckpointError(
            f"Cannot export {refused[0]!r} to safetensors: it is not a tensor of a dtype the "
            "format stores.",
            hint="Save a DCP folder instead (no max_shard_size), or convert that tensor.",
        )
    groups = plan_shards(state, limit)
    names = shard_names(len(groups))
    devices = {str(t.device) for t in state.values()}
    header = {"format": "pt", "gpukit": json.dumps(_info("sharded safetensors", metadata, devices))}
    gathered = 0

    def stream(handle: BinaryIO, keys: list[str]) -> None:
        nonlocal gathered
        head, sizes = _header({k: state[k] for k in keys}, header)
        handle.write(head)
        for key in keys:
            tensor = _full(state[key])
            gathered += 1
            if sizes[key]:
                handle.write(tensor.reshape(-1).view(torch.uint8).numpy().data)

    def fill(tmp: Path | None) -> None:
        if tmp is None or dist.get_rank() != 0:
            for key in state:
                _full(state[key])  # join rank 0's gathers, in the same order
            return
        try:
            for name, keys in zip(names, groups, strict=True):
                write_durable(tmp / name, partial(stream, keys=keys))
            index = {
                "metadata": {
                    "total_size": sum(t.numel() * t.element_size() for t in state.values())
                },
                "weight_map": {
                    k: n for n, keys in zip(names, groups, strict=True) for k in sorted(keys)
                },
            }
            encoded = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            write_durable(tmp / SAFETENSORS_INDEX, lambda handle: handle.write(encoded))
        except BaseException:
            for key in list(state)[gathered:]:
                _full(state[key])  # the other ranks still wait in these gathers
            raise

    _in_folder(path, fill)


def _save_file(
    model: nn.Module, path: Path, metadata: Mapping[str, Any], save: Callable[..., Path]
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)  # on rank 0 only
    _agree(lambda: save(full, path, metadata=metadata))


def save_sharded(
    obj: object,
    path: Path,
    *,
    layout: str,
    shard_limit: int | None,
    metadata: Mapping[str, Any],
    save_file: Callable[..., Path],
) -> Path:
    """Save a sharded model (or a dict holding one) from every rank; see the module's summary.

    Args:
        obj: the sharded model, or a dict holding it (with its optimizers and plain values).
        path: where to write.
        layout: what :func:`gpukit.checkpoint.api.save_layout` decided from ``path``:
            ``"safetensors"`` or ``"torch"`` (one file of the full weights, gathered on rank
            0), or ``"sharded safetensors"`` (a folder).
        shard_limit: for a folder, the shard size asked for (Hugging Face's layout of the full
            weights), or ``None`` (a DCP folder, each rank writing its own part).
        metadata: JSON-ready values recorded with full weights.
        save_file: gk.save itself, which rank 0 calls as ``save_file(state_dict, path,
            metadata=...)`` to write the gathered weights as one file.

    Raises:
        InvalidArgumentError: a dict asked of a one-file or exported layout, two models, or
            metadata for a DCP folder (raised on every rank, before any rank waits).
        CheckpointError: not every rank called this (raised on the ranks that did, within
            :data:`JOIN_TIMEOUT`), or the target cannot be written (raised on every rank).
    """
    full_weights = layout != _FOLDER or shard_limit is not None
    if full_weights and not isinstance(obj, nn.Module):
        raise InvalidArgumentError(
            f"gk.save got a dict holding a sharded model, and {path.name} asks for full "
            "weights; only the model's weights are exported that way.",
            hint="Save the dict to a folder (a DCP checkpoint, without max_shard_size), or "
            "pass the model alone to export its weights.",
        )
    if not full_weights and metadata:
        raise InvalidArgumentError(
            f"gk.save got metadata for {path.name}, a DCP folder, which has no place to keep it.",
            hint='Save it as an entry instead: gk.save({"model": model, "info": {...}}, path).',
        )
    if len(_modules(obj)) != 1:
        raise InvalidArgumentError(
            f"gk.save got a dict with {len(_modules(obj))} models; a sharded checkpoint holds one.",
            hint="Save each model to its own folder.",
        )
    _join(obj, "gk.save")
    if layout != _FOLDER:
        assert isinstance(obj, nn.Module)
        _save_file(obj, path, metadata, save_file)
    elif shard_limit is not None:
        assert isinstance(obj, nn.Module)
        _export(obj, path, shard_limit, metadata)
    else:
        _save_dcp(obj, path)
    return path


def _planning_view(model_state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The model's keys with shape-only tensors of their full shapes, for matching keys."""
    return {
        key: torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")
        for key, value in model_state.items()
        if isinstance(value, torch.Tensor)
    }


def _plan(
    model: nn.Module, path: Path, *, strict: bool, trust: bool
) -> tuple[Source, LoadPlan, LoadReport]:
    source = open_source(path, target=torch.device("cpu"), trust=trust)
    _, plan, report = plan_source(
        source,
        _planning_view(model.state_dict()),
        device=str(_local_device(model)),
        model_name=_class_name(model),
        strict=strict,
    )
    return source, plan, report


def _class_name(model: nn.Module) -> str:
    """The model's own class name, not the FSDP<Name> class fully_shard swaps in."""
    cls = type(model)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule":
        return bases[1].__name__
    return cls.__name__


def _local_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    if param is None:
        return torch.device("cpu")
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.device


def _load_dcp(model: nn.Module, path: Path, *, strict: bool, trust: bool) -> LoadReport:
    # Every rank plans alone (the same files give the same plan) and reads only the chunks its
    # shards need, through DCP's planner: any number of processes may have saved the folder.
    inner, _ = unwrap(model)
    source, plan, report = _plan(inner, path, strict=strict, trust=trust)
    source.read_into(plan.targets(inner.state_dict()), trust=trust)
    return report


def _load_full(model: nn.Module, path: Path, *, strict: bool, trust: bool) -> LoadReport:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    inner, _ = unwrap(model)
    full: dict[str, Any] = {}

    def read() -> LoadReport:
        source, plan, report = _plan(inner, path, strict=strict, trust=trust)
        # Empty tensors of the stored shapes, read into by the source, whatever its layout.
        for name, value in plan.renamed.items():
            full[name] = torch.empty(tuple(value.shape), dtype=value.dtype)
        source.read_into(plan.targets(full), trust=trust)
        return report

    report = _agree(read)
    assert report is not None
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(inner, full, options=options)
    return report


def load_sharded(model: nn.Module, path: Path, *, strict: bool, trust: bool) -> LoadReport:
    """Load a checkpoint into a sharded model, on every rank at once; see the module's summary.

    Raises:
        CheckpointError: not every rank called this (raised on the ranks that did, within
            :data:`JOIN_TIMEOUT`), or the checkpoint cannot be read or does not fit the model
            (with ``strict``), raised on every rank.
    """
    _join(model, "gk.load")
    dcp = (path.is_dir() and is_dcp_folder(path)) or (
        path.name == METADATA_NAME and is_dcp_folder(path.parent)
    )
    if dcp:
        return _load_dcp(model, path, strict=strict, trust=trust)
    return _load_full(model, path, strict=strict, trust=trust)
