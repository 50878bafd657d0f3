"""prepare(): a model, its optimizer and its data made ready for one process of N, on DDP."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, TypeVar, overload

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from gpukit.checkpoint.dtensor import is_sharded
from gpukit.distributed.batch_sizes import micro_batches
from gpukit.distributed.data import DistributedLoader
from gpukit.distributed.position import checked_seed
from gpukit.distributed.process_group import DistributedContext, _leave_with_the_group, _ready
from gpukit.distributed.weights import SampleWeights, weighted_allreduce
from gpukit.errors import InvalidArgumentError, check_bool
from gpukit.train.context import StepContext
from gpukit.train.exact import ExactPlan, ExactReduceScatter, exact_plan
from gpukit.train.precision import Precision, autocast_forward, resolve_precision
from gpukit.train.shard import ShardPolicy, shard_model
from gpukit.train.step import TrainStep
from gpukit.transfer import to_device

M = TypeVar("M", bound=nn.Module)
Opt = TypeVar("Opt", bound=Optimizer)

__all__ = ["prepare"]

log = logging.getLogger("gpukit.distributed")


def _prepare_model(
    model: nn.Module, ctx: DistributedContext, ddp: Mapping[str, Any], context: StepContext
) -> Any:
    if isinstance(model, DistributedDataParallel) or is_sharded(model):
        return model
    model = to_device(model, ctx.device)  # the fp32 master weights, whatever the precision
    if ctx.world_size == 1:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=ids, **ddp)
    # Shares of a global batch may differ (the last batch of an epoch): weigh each rank's
    # gradient by its samples, not by 1/N, so the step is the one a single process takes. The
    # hook reads them from the step context the prepared loader fills.
    wrapped.register_comm_hook(SampleWeights(ctx.world_size, context), weighted_allreduce)
    _leave_with_the_group(wrapped)
    return wrapped


def _check_objects(model: object, optimizer: object, loader: object) -> None:
    """Refuse what prepare() cannot wire, above all a loader passed where the optimizer goes."""
    for name, obj, kind, label in (
        ("model", model, nn.Module, "torch.nn.Module"),
        ("optimizer", optimizer, Optimizer, "torch.optim.Optimizer"),
        ("loader", loader, DataLoader, "torch.utils.data.DataLoader"),
    ):
        if isinstance(obj, kind) or (obj is None and name != "model"):
            continue
        by_keyword = name == "optimizer" and isinstance(obj, DataLoader) and loader is None
        raise InvalidArgumentError(
            f"prepare() got a {type(obj).__name__} as its {name}, where it needs a {label}.",
            hint="Pass the loader by keyword: prepare(model, loader=loader, ...)."
            if by_keyword
            else "Call prepare(model, optimizer=None, loader=None, ...) with those types.",
        )


def _prepare_optimizer(optimizer: Optimizer, ctx: DistributedContext) -> Optimizer:
    # The model was moved in place, so the optimizer's parameters are already right; only state
    # it holds (Adam's moments after a resume) must follow. "step" stays on the CPU, as torch
    # keeps it there for non-capturable optimizers.
    for key, state in list(optimizer.state.items()):
        optimizer.state[key] = to_device(state, ctx.device, skip=("step",))
    return optimizer


@overload
def prepare(model: M, *, precision: str = ...) -> M | DistributedDataParallel: ...
@overload
def prepare(
    model: M,
    optimizer: Opt,
    loader: None = ...,
    *,
    per_device_batch_size: int | None = ...,
    global_batch_size: int | None = ...,
    accumulate: int | None = ...,
    micro_batch_size: int | None = ...,
    exact: bool = ...,
    precision: str = ...,
    seed: int = ...,
    ddp_kwargs: Mapping[str, Any] | None = ...,
    shard: ShardPolicy = ...,
    stand_in: bool = ...,
) -> tuple[M | DistributedDataParallel, Opt]: ...
@overload
def prepare(
    model: M,
    optimizer: Opt,
    loader: DataLoader[Any],
    *,
    per_device_batch_size: int | None = ...,
    global_batch_size: int | None = ...,
    accumulate: int | None = ...,
    micro_batch_size: int | None = ...,
    exact: bool = ...,
    precision: str = ...,
    seed: int = ...,
    ddp_kwargs: Mapping[str, Any] | None = ...,
    shard: ShardPolicy = ...,
    stand_in: bool = ...,
) -> tuple[M | DistributedDataParallel, Opt, DistributedLoader]: ...
@overload
def prepare(
    model: M,
    optimizer: None = ...,
    *,
    loader: DataLoader[Any],
    per_device_batch_size: int | None = ...,
    global_batch_size: int | None = ...,
    accumulate: int | None = ...,
    micro_batch_size: int | None = ...,
    exact: bool = ...,
    precision: str = ...,
    seed: int = ...,
    ddp_kwargs: Mapping[str, Any] | None = ...,
    shard: ShardPolicy = ...,
    stand_in: bool = ...,
) -> tuple[M | DistributedDataParallel, DistributedLoader]: ...
@overload
def prepare(
    model: M,
    optimizer: None,
    loader: DataLoader[Any],
    *,
    per_device_batch_size: int | None = ...,
    global_batch_size: int | None = ...,
    accumulate: int | None = ...,
    micro_batch_size: int | None = ...,
    exact: bool = ...,
    precision: str = ...,
    seed: int = ...,
    ddp_kwargs: Mapping[str, Any] | None = ...,
    shard: ShardPolicy = ...,
    stand_in: bool = ...,
) -> tuple[M | DistributedDataParallel, DistributedLoader]: ...
def prepare(
    model: nn.Module,
    optimizer: Optimizer | None = None,
    loader: DataLoader[Any] | None = None,
    *,
    per_device_batch_size: int | None = None,
    global_batch_size: int | None = None,
    accumulate: int | None = None,
    micro_batch_size: int | None = None,
    exact: bool = False,
    precision: str = "fp32",
    seed: int = 0,
    ddp_kwargs: Mapping[str, Any] | None = None,
    shard: ShardPolicy = False,
    stand_in: bool = False,
) -> Any:
    """Move the model (and DDP-wrap it when there are several processes), shard the loader.

    Returns what it was given, in the same order, without the ``None`` s: ``model``,
    ``(model, optimizer)``, ``(model, loader)`` or ``(model, optimizer, loader)``. A loader
    needs an explicit batch size: ``per_device_batch_size=B`` (each process loads B samples) or
    ``global_batch_size=G`` (one step sees G samples over all processes). Each global batch
    (shuffled with ``seed``, a new shuffle each epoch, when the loader shuffled) is split over
    the processes without repeating any sample, and its batches arrive on this process's
    device. The DDP model weighs each process's gradient by its share of the global batch, so
    N processes end with the same weights as one, whatever the dataset's size; in the last
    step of an epoch a process may get fewer samples than the others, or an empty batch.

    ``accumulate=K`` cuts each global batch into K micro-batches per process (or give
    ``per_device_batch_size`` and a larger ``global_batch_size``: the micro-batch and the global
    batch, K derived); gradients are all-reduced once per optimizer step and every micro-batch is
    weighed by its share of the step's samples (or of the counts given to ``dist.step``), so
    the step is still one process's step on the whole global batch. ``precision`` is
    ``"fp32"`` (default), ``"bf16-mixed"``, ``"fp16-mixed"`` or ``"auto"`` (see
    :func:`gpukit.train.precision.resolve_precision`): the model's forward runs under autocast,
    weights and gradients stay fp32; what ``"auto"`` chose is logged (logger
    ``gpukit.train``, INFO) and is ``loader.precision.name``. With either, end each batch with
    ``dist.step(loss)`` in place of ``opt.zero_grad(); loss.backward(); opt.step()``.

    The loader, its training step (``loader.train_step``) and the model's gradient hook share
    one :class:`~gpukit.train.context.StepContext` (``loader.context``): the loader writes each
    micro-batch's place and share into it, the step and the hook read them there.

    >>> model, opt, loader = prepare(model, opt, loader, global_batch_size=256,
    ...                              accumulate=4, precision="auto")  # doctest: +SKIP

    ``shard=True`` (or module classes, or a function of a module: see
    :mod:`gpukit.train.shard`) shards the model with FSDP2 instead of copying it with DDP: each
    process holds 1/N of the parameters, gradients and optimizer state, and the gradients are
    weighed the same way, so the promise above holds (accumulation included: FSDP skips its
    reduce-scatter on all but the last micro-batch). The optimizer is moved onto the sharded
    parameters. A mixed precision computes in its dtype there too (FSDP's
    ``MixedPrecisionPolicy``), gradients reduced in float32.

    >>> model, opt, loader = prepare(model, opt, loader, global_batch_size=64)  # doctest: +SKIP
    >>> model, opt = prepare(model, opt, shard=True)  # doctest: +SKIP

    ``exact=True`` promises more: bitwise the same weights and optimizer state on 1, 2, 4 (any
    number that leaves each process a power of two of micro-batches) processes, and after a
    resume on another number. Each step's ``global_batch_size`` is cut into micro-batches of
    ``micro_batch_size``, the same cut for every number of processes, and their gradients are
    added in one fixed order (:mod:`gpukit.train.exact`) instead of by DDP's all-reduce: the
    model is not wrapped in DDP, and ``dist.step(loss)`` does the sum. It turns on
    ``torch.use_deterministic_algorithms``; it refuses what it cannot make exact (fp16, batch
    norm's running statistics, a number of processes the sum cannot keep in order), naming the
    nearest exact configuration. With ``shard=`` the sharded model's reduce-scatters add in the
    same order: FSDP2 exact ends with DDP exact's weights.

    >>> model, opt, loader = prepare(model, opt, loader, exact=True, global_batch_size=64,
    ...                              micro_batch_size=8, precision="bf16-mixed")  # doctest: +SKIP

    Args:
        model: the model to train, bare (prepare moves it and wraps it for several processes).
        optimizer: its optimizer, or None.
        loader: the DataLoader to shard over the processes, or None.
        per_device_batch_size: with a loader, the samples each process loads per micro-batch.
        global_batch_size: with a loader, the samples one optimizer step sees over all
            processes (instead of ``per_device_batch_size``).
        accumulate: micro-batches per optimizer step, 1 or more; None: 1.
        micro_batch_size: with ``exact=True``, the samples of one micro-batch, the same for
            every number of processes (the micro-batches per process follow).
        exact: the same bits on any number of processes (see above); False by default.
        precision: "fp32" (the default), "bf16-mixed", "fp16-mixed" or "auto".
        seed: the shuffle's seed, the same on every rank (0 by default).
        ddp_kwargs: options for ``DistributedDataParallel``, or None.
        shard: False (DDP, the default); or FSDP2 with True (repeated blocks as units), the
            module classes to shard as units, or a function that says whether to shard one.
        stand_in: with a loader, a rank whose share of a micro-batch is empty (the end of an
            epoch) gets a stand-in, one real sample the step weighs 0, instead of a batch of
            0 rows: for models that cannot run on 0 rows, such as Hugging Face's.

    Raises:
        InvalidArgumentError: an object of the wrong type, batch sizes that do not fit together,
            ``accumulate`` without a loader or with a model wrapped in DDP already, an unknown
            precision, a ``seed`` that is not a whole number from 0 to 2**63 - 1; in exact
            mode, what it cannot make exact (see :func:`_exact_checks`).
        DeviceError: a precision this process's device cannot run natively.
    """
    _check_objects(model, optimizer, loader)
    checked_seed(seed)  # before any work: the loader's shuffle, saved with its position
    check_bool("exact", exact)
    check_bool("stand_in", stand_in)
    if stand_in and loader is None:
        raise InvalidArgumentError(
            "prepare() got stand_in=True without a loader.",
            hint="stand_in= changes the batches of a prepared loader: pass the loader too.",
        )
    ctx = _ready()
    resolved = resolve_precision(precision, ctx.device)
    steps = 1
    if exact or micro_batch_size is not None:
        plan = _exact_checks(
            model,
            optimizer,
            loader,
            world_size=ctx.world_size,
            exact=exact,
            sizes=(per_device_batch_size, global_batch_size, micro_batch_size, accumulate),
            precision=resolved,
            shard=shard,
            ddp_kwargs=ddp_kwargs,
        )
        return _prepare_exact(model, optimizer, loader, plan, ctx, resolved, seed, shard, stand_in)
    if loader is not None:
        size, steps = micro_batches(
            ctx.world_size, per_device_batch_size, global_batch_size, accumulate
        )
    elif accumulate is not None and accumulate != 1:
        raise InvalidArgumentError(
            f"prepare() got accumulate={accumulate!r} without a loader.",
            hint="Accumulation follows the prepared loader's micro-batches: pass the loader too.",
        )
    if resolved.scaled and optimizer is not None and loader is None:
        raise InvalidArgumentError(
            "prepare() got precision='fp16-mixed' with an optimizer but no loader: the "
            "gradient scaler runs in the step of a prepared loader's loop.",
            hint="Pass the loader too and end each batch with dist.step(loss), or use "
            "gk.train.TrainStep(model, opt, precision=...) in your own loop.",
        )
    yours = isinstance(model, DistributedDataParallel)
    if yours and steps > 1:
        raise InvalidArgumentError(
            f"prepare() got accumulate={steps} and a model already wrapped in DDP, whose "
            "equal average over processes cannot weigh micro-batches exactly.",
            hint="Pass the bare model and let prepare() wrap it.",
        )
    if yours and optimizer is not None and loader is not None and ctx.world_size > 1:
        # The step weighs each rank's gradient by its samples; DDP's own all-reduce then
        # averages them again, and the step would take 1/N of the whole batch's gradient.
        raise InvalidArgumentError(
            "prepare() got a model already wrapped in DDP with an optimizer and a loader: its "
            "all-reduce averages the ranks' gradients equally, which the prepared step, "
            "weighing each rank by its samples, cannot correct.",
            hint="Pass the bare model and let prepare() wrap it (ddp_kwargs= passes DDP's "
            "options).",
        )
    context = StepContext(steps, precision=resolved)
    if shard is not False:  # FSDP2 in place of DDP (train/shard.py)
        weight = SampleWeights(ctx.world_size, context).weight
        model = shard_model(
            model,
            shard,
            device=ctx.device,
            weight=weight,
            optimizer=optimizer,
            param_dtype=resolved.dtype,
        )
    prepared = _prepare_model(model, ctx, ddp_kwargs or {}, context)
    inner = prepared.module if isinstance(prepared, DistributedDataParallel) else prepared
    autocast_forward(inner, resolved)
    out: list[Any] = [prepared]
    if optimizer is not None:
        out.append(_prepare_optimizer(optimizer, ctx))
    if loader is not None:
        if optimizer is not None:  # binds itself to the context: loader.train_step
            TrainStep(
                prepared,
                optimizer,
                context=context,
                hooked=(isinstance(prepared, DistributedDataParallel) and not yours)
                or is_sharded(prepared),
                distributed=ctx.world_size > 1,
            )
        out.append(
            DistributedLoader(
                loader,
                batch_size=size,
                rank=ctx.rank,
                world_size=ctx.world_size,
                device=ctx.device,
                seed=seed,
                accumulate=steps,
                context=context,
                stand_in=stand_in,
            )
        )
    return out[0] if len(out) == 1 else tuple(out)


def _exact_checks(
    model: nn.Module,
    optimizer: Optimizer | None,
    loader: DataLoader[Any] | None,
    *,
    world_size: int,
    exact: bool,
    sizes: tuple[int | None, int | None, int | None, int | None],
    precision: Precision,
    shard: ShardPolicy,
    ddp_kwargs: Mapping[str, Any] | None,
) -> ExactPlan:
    """What exact mode needs, checked before any work, the same on every rank.

    Raises:
        InvalidArgumentError: ``micro_batch_size`` without ``exact=True``; no optimizer or
            loader; ``per_device_batch_size`` or ``accumulate`` (the cut decides them);
            ``ddp_kwargs`` (no DDP runs); fp16 (its scaler is not exact yet);
            a model wrapped already or with batch norm's running statistics (updated per
            micro-batch in each process's own order); sizes that do not cut exactly (see
            :func:`~gpukit.train.exact.exact_plan`).
    """
    per_device, global_size, micro, accumulate = sizes

    def refuse(what: str, hint: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"prepare(exact=True) {what}", hint=hint)

    if not exact:
        raise InvalidArgumentError(
            f"prepare() got micro_batch_size={micro!r} without exact=True: outside exact mode "
            "the micro-batch is per_device_batch_size.",
            hint="Pass exact=True too, or per_device_batch_size= in its place.",
        )
    if optimizer is None or loader is None:
        raise refuse(
            "needs the optimizer and the loader: the fixed-order sum runs in the step of the "
            "prepared loader's loop.",
            hint="Call prepare(model, opt, loader, exact=True, ...) and end each batch with "
            "dist.step(loss).",
        )
    if per_device is not None or accumulate is not None:
        raise refuse(
            "takes global_batch_size= and micro_batch_size= only: the micro-batches per "
            "process follow from them and the number of processes.",
            hint="Leave per_device_batch_size= and accumulate= out.",
        )
    if ddp_kwargs:
        raise refuse(
            "runs no DDP: it adds the gradients itself, in one order.",
            hint="Leave ddp_kwargs= out.",
        )
    if precision.scaled:
        raise refuse(
            "does not run fp16: its loss scaler skips steps by a check not yet made exact.",
            hint="Use precision='bf16-mixed' (exact) or 'fp32'.",
        )
    if isinstance(model, DistributedDataParallel) or is_sharded(model):
        raise refuse(
            f"got a model already wrapped ({type(model).__name__}), whose gradients are summed "
            "in the wrapper's own order.",
            hint="Pass the bare model.",
        )
    norms = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats
    ]
    if norms:
        raise refuse(
            f"cannot keep batch norm's running statistics exact ({norms[0] or 'the model'}): "
            "each process updates them in the order of its own micro-batches.",
            hint="Use LayerNorm or GroupNorm, or BatchNorm with track_running_stats=False.",
        )
    return exact_plan(world_size, global_size, micro)


def _prepare_exact(
    model: nn.Module,
    optimizer: Optimizer | None,
    loader: DataLoader[Any] | None,
    plan: ExactPlan,
    ctx: DistributedContext,
    precision: Precision,
    seed: int,
    shard: ShardPolicy,
    stand_in: bool,
) -> tuple[nn.Module, Optimizer, DistributedLoader]:
    """Exact mode's model (moved, rank 0's weights on every rank, not wrapped; or sharded with
    the exact reduce-scatter), optimizer and loader, sharing one step context."""
    assert optimizer is not None  # _exact_checks
    assert loader is not None
    # Deterministic kernels: cuBLAS needs its fixed workspace before its first call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if ctx.device.type == "cpu" and torch.get_num_threads() != 1:
        # A CPU kernel splits its work by the intra-op thread count, and a split can change
        # its rounding (measured: a 1-process run on 2 threads ended 1 ulp from 2 processes on
        # 1). torchrun gives each of several processes one thread; one process gets it too.
        log.info("exact mode: one intra-op thread (was %d)", torch.get_num_threads())
        torch.set_num_threads(1)
    model = to_device(model, ctx.device)
    if ctx.world_size > 1:  # what DDP's construction does: every rank starts from rank 0's
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                torch_dist.broadcast(tensor, src=0)
    context = StepContext(plan.per_process, precision=precision)
    if shard is not False:
        # The compute dtype comes from autocast alone, as unsharded (FSDP's param_dtype would
        # run every layer in bf16, norms included): float32 all-gathers buy equal bits.
        model = shard_model(
            model,
            shard,
            device=ctx.device,
            weight=lambda: 1.0,
            optimizer=optimizer,
            reduce_scatter=lambda: ExactReduceScatter(plan, context),
        )
    autocast_forward(model, precision)
    TrainStep(model, optimizer, context=context, distributed=ctx.world_size > 1, exact=plan)
    prepared = DistributedLoader(
        loader,
        batch_size=plan.micro_batch_size,
        rank=ctx.rank,
        world_size=ctx.world_size,
        device=ctx.device,
        seed=seed,
        context=context,
        exact=plan,
        stand_in=stand_in,
    )
    return model, _prepare_optimizer(optimizer, ctx), prepared
