"""The sharded part of a save: each rank writes and reads only its own shards, through DCP.

For a model sharded with FSDP2 the model's and the optimizer's state are DTensors holding this
rank's rows (``get_state_dict``, the optimizer keyed by parameter names). :func:`write` saves them
into the save's ``sharded/`` folder through the checkpoint layer's one DCP writer
(:func:`gpukit.checkpoint.dcp.write_dcp`, which ``gk.save`` of a sharded model uses too): each
rank writes its own shards into its own file and fsyncs it, and the coordinator (rank 0 of the
save's group) writes ``.metadata`` once every rank's file is written. Nothing is gathered: no
rank holds more than its own shards, whatever the model's size.

:func:`read` fills the state dict this run builds (sharded over any number of processes, or a
plain model) with the chunks each rank needs (DCP's planner reshards), through gpukit's checked
reader of DCP metadata (a save is a file others may have changed), then applies it
(``set_state_dict``). :func:`load_whole` puts a whole state (an unsharded run's save) into a
sharded model instead.

Each rank meets the others in the save's own gloo group, so the writer thread's collectives
never interleave with the training loop's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from gpukit._agree import all_true
from gpukit.checkpoint.dcp import open_dcp, write_dcp
from gpukit.errors import CheckpointError

__all__ = ["load_whole", "read", "sharded_state", "stager", "write"]


def sharded_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """This rank's shards of the model's (and the optimizer's) state: live tensors, not copies.

    An optimizer that holds no state yet (no step taken, or a stateless one) is left out:
    ``get_state_dict`` would take a step of it with zero gradients to make its state, which
    changes the run being saved (AdamW's step count). Its options are saved as plain data.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None or not optimizer.state:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def stager(model: nn.Module) -> Any:
    """torch's stager of a state dict in host memory, for the model's device.

    It copies each DTensor's local shard and keeps the DTensor around it, and copies into the
    same host buffers save after save (the first touch of fresh memory costs as much as the
    write). Pinned memory and copies without a wait per tensor on a GPU only.
    """
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    param = next(model.parameters(), None)
    local = param.to_local() if param is not None and hasattr(param, "to_local") else param
    on_gpu = local is not None and local.device.type == "cuda"
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=on_gpu,
            use_shared_memory=False,
            use_async_staging=False,  # save() returns once the copy is done, as for the rest
            use_non_blocking_copy=on_gpu,
        )
    )


def write(folder: Path, state: dict[str, Any], group: Any) -> None:
    """Save ``state`` into the DCP folder ``folder``: this rank's shards, on every rank at once.

    The checkpoint layer's one DCP writer, :func:`gpukit.checkpoint.dcp.write_dcp`: every data
    file, ``.metadata`` and the folder are fsynced; once this returns on any rank, every rank's
    shards and the metadata are written.

    Args:
        folder: the save's ``sharded/`` folder, made by the caller.
        state: this rank's shards (:func:`sharded_state`, or their staged copy).
        group: the saves' own gloo group.

    Raises:
        CheckpointError: a rank could not write its part (raised on every rank).
    """
    write_dcp(folder, state, group=group)


def read(folder: Path, model: nn.Module, optimizer: Any, group: Any) -> None:
    """Load the DCP folder ``folder`` into ``model`` (and ``optimizer``), on every rank at once.

    Raises:
        CheckpointError: the folder is damaged or missing a part, or holds another model's
            state (raised on every rank, before anything is loaded).
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    failure: CheckpointError | None = None
    try:
        checked = open_dcp(folder)  # its .metadata read without running code, its files there
    except CheckpointError as exc:
        failure = exc
    if not all_true(failure is None, group):
        raise failure or CheckpointError(
            f"{folder} cannot be read on another rank.",
            hint="Every rank must see the same save (a file system they share).",
        )
    state: dict[str, Any]
    fresh = optimizer is not None and not optimizer.state
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        # A fresh optimizer gets its state made here (a step with zero gradients and a zero
        # learning rate): the state read next replaces it.
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": dict(optimizer_state)}
    try:
        checked.load(state, process_group=group)
    except BaseException:
        if fresh:  # a refused read leaves a fresh optimizer without state, as it found it
            optimizer.state.clear()
        raise
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_whole(model: nn.Module, optimizer: Any, model_state: Any, optimizer_state: Any) -> None:
    """Put a whole state (an unsharded run's save, read by every rank) into a sharded model:
    each rank keeps its own rows of every tensor.

    ``optimizer_state`` is the optimizer's own ``state_dict()`` (parameters numbered in the
    order of its groups); it is keyed by parameter names here, as torch's loader of sharded
    optimizers asks. None leaves the optimizer as it is.

    Raises:
        CheckpointError: the optimizer's state names parameters this optimizer does not have.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    if optimizer is None or optimizer_state is None:
        return
    if isinstance(optimizer_state, dict) and not optimizer_state.get("state"):
        optimizer.load_state_dict(optimizer_state)  # no moments yet: its options only
        return
    named = _by_name(optimizer_state, optimizer, model)
    set_optimizer_state_dict(model, optimizer, named, options=options)


def _by_name(saved: Any, optimizer: Any, model: nn.Module) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` with each parameter number replaced by its name."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    try:
        state = {_name(order, number): value for number, value in saved["state"].items()}
        groups = [
            {**group, "params": [_name(order, number) for number in group["params"]]}
            for group in saved["param_groups"]
        ]
    except (KeyError, TypeError, AttributeError, IndexError):
        raise CheckpointError(
            f"The saved optimizer state does not fit this optimizer over {len(order)} parameters.",
            hint="Resume with the optimizer the run saved (same parameters, same groups).",
        ) from None
    return {"state": state, "param_groups": groups}


def _name(order: list[str | None], number: object) -> str:
    if type(number) is not int or not 0 <= number < len(order) or order[number] is None:
        raise IndexError(number)
    found = order[number]
    assert found is not None
    return found
