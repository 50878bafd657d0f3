"""Sharded training on FSDP2: each process holds 1/N of the parameters, gradients and moments.

:func:`shard` applies torch's ``fully_shard`` to the blocks a policy names and then to the root,
so each block's full parameters exist only during its own forward and backward. The default
policy shards each *repeated block*: walking down from the root, the children of one module that
share a class (and hold parameters) are blocks, as a transformer's stack of layers is built
(``nn.ModuleList([Block(...) for _ in range(n)])``); the walk does not descend into a block.

Exactness: gpukit weighs each process's gradient by its share of the global batch (the last
batch of an epoch may split unevenly, or leave a process with none), so that N processes take
the step one process takes. FSDP averages the ranks' gradients in its reduce-scatter; here the
reduce-scatter is a plain sum (``set_force_sum_reduction_for_comms``, a divide factor of 1) of
gradients each rank has first multiplied by its own weight (:class:`WeightedReduceScatter`,
installed with ``set_custom_reduce_scatter``).

This module asks torch.distributed for the group; it never imports ``gpukit.distributed``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from gpukit.checkpoint.dtensor import is_sharded
from gpukit.errors import InvalidArgumentError

__all__ = [
    "PlainBuffers",
    "ShardPolicy",
    "WeightedReduceScatter",
    "blocks_to_shard",
    "mixed_precision",
    "repeated_blocks",
    "shard",
    "shard_model",
]

ShardPolicy: TypeAlias = (
    "bool | type[nn.Module] | Iterable[type[nn.Module]] | Callable[[nn.Module], bool]"
)
"""``True`` (repeated blocks), module classes, or a function that says whether to shard a module."""


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The default policy's blocks: children of one parent that share a class, outermost first.

    >>> stack = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> [type(m).__name__ for m in repeated_blocks(stack)]
    ['Linear', 'Linear']
    """
    found: list[nn.Module] = []
    pending = [model]
    while pending:
        parent = pending.pop(0)
        children = [c for c in parent.children() if _has_parameters(c)]
        counts = Counter(type(c) for c in children)
        for child in children:
            if counts[type(child)] > 1:
                found.append(child)
            else:
                pending.append(child)
    return found


def _as_classes(policy: object) -> tuple[type[nn.Module], ...] | None:
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        return (policy,)
    if (
        isinstance(policy, (list, tuple, set, frozenset))
        and policy
        and all(isinstance(c, type) and issubclass(c, nn.Module) for c in policy)
    ):
        return tuple(policy)
    return None


def blocks_to_shard(model: nn.Module, policy: ShardPolicy) -> list[nn.Module]:
    """The submodules ``policy`` names, innermost first (the root is not among them).

    ``True`` is :func:`repeated_blocks`; module classes name every submodule of those classes;
    a function is called with each submodule and returns whether to shard it. Nested choices
    are allowed: a block inside a block is sharded first, as ``fully_shard`` requires.

    Raises:
        InvalidArgumentError: ``policy`` is none of those.
    """
    if policy is True:
        chosen = repeated_blocks(model)
        return [m for m in reversed(list(model.modules())) if any(m is c for c in chosen)]
    classes = _as_classes(policy)
    if classes is not None:
        test: Callable[[nn.Module], bool] = lambda m: isinstance(m, classes)  # noqa: E731
    elif callable(policy) and not isinstance(policy, (type, nn.Module)):
        test = policy
    else:
        raise InvalidArgumentError(
            f"shard={policy!r} is not a sharding policy.",
            hint="Pass shard=True (each repeated block), a module class or a list of classes "
            "(shard=[Block]), or a function that takes a module and returns True to shard it.",
        )
    inner = [m for m in model.modules() if m is not model]
    return [m for m in reversed(inner) if _has_parameters(m) and bool(test(m))]


class PlainBuffers(ReduceScatter):
    """A custom reduce-scatter's buffers: plain ones, fresh on each call, as FSDP's own."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A new buffer on ``device`` (exact mode keeps some: none is handed out twice)."""
        return torch.empty(*size, dtype=dtype, device=device)


class WeightedReduceScatter(PlainBuffers):
    """FSDP's reduce-scatter as a sum of gradients each rank first weighs by its own ``weight()``.

    ``weight`` is read when the gradients are reduced (after the last backward of a step), so
    it can follow the batch being processed: ``n_r / n`` for a rank with ``n_r`` of the global
    batch's ``n`` samples. A weight of 0 (a rank with no sample) contributes zeros, even where
    its loss over no sample read nan. FSDP must reduce with a plain sum for this to hold, which
    :func:`shard` asks of every sharded module.
    """

    def __init__(self, weight: Callable[[], float]) -> None:
        self.weight = weight

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Weigh this rank's (flat, padded) gradients, then reduce-scatter them as a sum."""
        weight = self.weight()
        if weight == 0.0:
            input_tensor.zero_()
        elif weight != 1.0:
            input_tensor.mul_(weight)
        work: dist.Work | None = dist.reduce_scatter_single(
            output=output_tensor,
            input=input_tensor,
            op=dist.ReduceOp.SUM,
            group=group,
            async_op=async_op,
        )
        return work


def mixed_precision(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP's mixed precision for ``param_dtype``, reducing gradients in float32.

    ``None`` keeps the parameters' own dtype for compute and reduction (a float64 model reduces
    in float64). A low-precision compute dtype still sums gradients over ranks in float32, so
    the sum loses nothing that one process's float32 gradient would keep.
    """
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


@dataclass(frozen=True)
class _Plan:
    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    reduce_scatter: WeightedReduceScatter


def _mesh(device: torch.device, group: dist.ProcessGroup | None) -> DeviceMesh:
    # An explicit mesh of the training device's type: without it, fully_shard picks CUDA
    # whenever a GPU is visible and moves a model meant for the CPU there (pytorch#132471).
    whole = group if group is not None else dist.group.WORLD
    assert whole is not None  # shard() runs inside a group
    return DeviceMesh.from_group(whole, device_type=device.type)


def _own_class(model: nn.Module) -> str:
    """The name of the model's own class: ``fully_shard`` swaps it for ``FSDP<name>``, a
    subclass of FSDPModule and of the model's class."""
    return next(cls.__name__ for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def shard(
    model: nn.Module,
    policy: ShardPolicy = True,
    *,
    device: torch.device,
    weight: Callable[[], float],
    param_dtype: torch.dtype | None = None,
    group: dist.ProcessGroup | None = None,
    reduce_scatter: Callable[[], ReduceScatter] | None = None,
) -> nn.Module:
    """Shard ``model`` over the processes of ``group`` with FSDP2; returns it (an FSDPModule).

    Each block ``policy`` names (see :func:`blocks_to_shard`) and then the root become
    ``fully_shard`` units on a one-dimensional mesh of ``device``'s type; parameters become
    DTensors holding this rank's rows, and the model is moved to ``device``. Gradients are
    reduced as a sum weighted by ``weight()`` (see :class:`WeightedReduceScatter`). The
    optimizer must be built over the model's parameters *after* this call, or be handed the
    sharded parameters (``distributed.prepare`` does that for you). Sharded over the whole
    job, the model also gets the gloo group its gk.save and gk.load meet in first
    (:func:`gpukit.checkpoint.sharded_model.join_group`), made here while every rank is here.

    Args:
        model: the model to shard, in place.
        policy: which modules become sharded units (see :func:`blocks_to_shard`).
        device: the training device (the mesh's type).
        weight: this rank's factor on its gradients, read when they are reduced.
        param_dtype: the compute dtype of a mixed precision; None: the parameters' own.
        group: the process group to shard over; None: the whole job.
        reduce_scatter: makes each unit's own reduce-scatter (exact mode's keeps one unit's
            leaves); None: every unit shares one :class:`WeightedReduceScatter` of ``weight``.

    Raises:
        InvalidArgumentError: the model is sharded already, or ``policy`` is not a policy.
    """
    if is_sharded(model):
        raise InvalidArgumentError(
            f"the {_own_class(model)} is sharded already.",
            hint="Shard a model once: pass the plain model to prepare(..., shard=...).",
        )
    blocks = blocks_to_shard(model, policy)
    plan = _Plan(_mesh(device, group), mixed_precision(param_dtype), WeightedReduceScatter(weight))
    for block in blocks:
        fully_shard(block, mesh=plan.mesh, mp_policy=plan.mp_policy)
    fully_shard(model, mesh=plan.mesh, mp_policy=plan.mp_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Not recursive in torch: each unit keeps its own reduction settings.
            module.set_custom_reduce_scatter(
                plan.reduce_scatter if reduce_scatter is None else reduce_scatter()
            )
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    if (group is None or group is dist.group.WORLD) and dist.get_world_size() > 1:
        from gpukit.checkpoint.sharded_model import join_group  # only for a sharded model

        join_group(model)
    return model


def shard_model(
    model: nn.Module,
    policy: ShardPolicy,
    *,
    device: torch.device,
    weight: Callable[[], float],
    optimizer: torch.optim.Optimizer | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_scatter: Callable[[], ReduceScatter] | None = None,
) -> nn.Module:
    """:func:`shard` for a training script: the optimizer follows, one process shards nothing.

    ``optimizer``, built over the model's parameters before sharding, is pointed at the sharded
    parameters that replace them (same names, same groups and options). In a single process
    (no group, or a group of one) the policy is checked and the model returned as it is.

    Args:
        model: the model to shard, in place.
        policy: which modules become sharded units (see :func:`blocks_to_shard`).
        device: the training device.
        weight: this rank's factor on its gradients, read when they are reduced.
        optimizer: the optimizer built over the model's parameters, or None.
        param_dtype: the compute dtype of a mixed precision; None: the parameters' own.
        reduce_scatter: makes each unit's own reduce-scatter; None: the weighted one.

    Raises:
        InvalidArgumentError: the policy is not a policy, the optimizer holds state already
            (a resumed run: load its state after prepare()), or holds parameters of another
            model.
    """
    _check_ties(model, blocks_to_shard(model, policy))  # a bad policy fails in one process too
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    if optimizer is not None:
        _check_optimizer(optimizer, names)
    shard(
        model,
        policy,
        device=device,
        weight=weight,
        param_dtype=param_dtype,
        reduce_scatter=reduce_scatter,
    )
    if optimizer is not None:
        sharded = dict(model.named_parameters(remove_duplicate=False))
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return model


def _check_ties(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Refuse a policy that puts one parameter (tied weights) into two sharded units.

    Each unit replaces the parameters it manages (its own, less those of the units inside it)
    with sharded ones, so a parameter that two units manage (a language model's output layer
    tied to its input embedding, with the head made a unit of its own) would silently become
    two, trained apart.
    """
    units = [*blocks, model]
    inner = {id(unit) for unit in blocks}
    manager: dict[int, nn.Module] = {}
    for unit in units:
        for param in _managed(unit, inner):
            other = manager.setdefault(id(param), unit)
            if other is not unit:
                tied = [n for n, p in model.named_parameters(remove_duplicate=False) if p is param]
                raise InvalidArgumentError(
                    f"shard= puts the tied parameter {' = '.join(tied)} into two sharded units, "
                    "which would train it as two parameters.",
                    hint="Leave the module that shares it out of shard= (a language model's head "
                    "and its input embedding can both stay in the root unit), or untie them.",
                )


def _managed(unit: nn.Module, units: set[int]) -> list[nn.Parameter]:
    """The parameters ``unit`` shards itself: none of a unit inside it (ids in ``units``)."""
    found: list[nn.Parameter] = []
    stack = [unit]
    while stack:
        module = stack.pop()
        found.extend(module.parameters(recurse=False))
        stack.extend(c for c in module.children() if id(c) not in units)
    return found


def _check_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
    if optimizer.state:
        raise InvalidArgumentError(
            "prepare(..., shard=...) got an optimizer that holds state already; its moments "
            "belong to the whole parameters, which sharding replaces.",
            hint="Call prepare() with a fresh optimizer, then load the saved training state "
            "into the prepared model and optimizer.",
        )
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in names)
    if foreign:
        raise InvalidArgumentError(
            f"the optimizer holds {foreign} parameter(s) that are not the model's, so sharding "
            "the model cannot move them.",
            hint="Build the optimizer over model.parameters() of the model passed to prepare().",
        )
