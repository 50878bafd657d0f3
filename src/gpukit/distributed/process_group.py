"""The process group: join it, ask who this process is, and prepare a model and data for it.

Process groups and rendezvous are torch.distributed's and torchrun's; this module only reads
their environment, picks the backend and device, and wires the model and data.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from gpukit import _tree
from gpukit.devices import device as _auto_device
from gpukit.distributed.data import (
    DistributedLoader,
    SampleWeights,
    active_loader,
    per_device_size,
    weighted_allreduce,
)
from gpukit.distributed.environment import Environment, check_devices, environment
from gpukit.errors import DistributedError, InvalidArgumentError
from gpukit.transfer import to_device

T = TypeVar("T")
M = TypeVar("M", bound=nn.Module)
Opt = TypeVar("Opt", bound=Optimizer)

__all__ = [
    "DistributedContext",
    "all_reduce_mean",
    "barrier",
    "gather_for_metrics",
    "get_logger",
    "init",
    "is_main",
    "local_rank",
    "prepare",
    "print_main",
    "rank",
    "world_size",
]


@dataclass(frozen=True)
class DistributedContext:
    """This process's place in the run: ranks, backend (None when single) and its device."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str | None
    device: torch.device

    @property
    def distributed(self) -> bool:
        """True when a process group is up (even a group of one started by torchrun)."""
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the process that should print, log and save."""
        return self.rank == 0


_context: DistributedContext | None = None


def _pick(found: Environment, backend: str | None) -> tuple[str, torch.device]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "gloo" or count == 0 or not dist.is_nccl_available():
        if backend == "nccl":
            raise DistributedError(
                f"backend 'nccl' was asked for, but this process sees {count} usable CUDA "
                "devices" + ("" if count else " (CUDA_VISIBLE_DEVICES, driver)") + ".",
                hint="Run on GPUs, or use backend='gloo'.",
            )
        return backend or "gloo", torch.device("cpu")
    # A local rank beyond this process's GPUs would wait forever for a peer that never joins:
    # say so now, naming the variables, instead of falling back or hanging in the rendezvous.
    check_devices(found, count, "CUDA (torch.cuda.device_count())")
    return backend or "nccl", torch.device("cuda", found.cuda_index)


def _check_backend(backend: object) -> None:
    """Refuse a backend torch does not know, even where no launcher would have used it."""
    if backend is None:
        return
    known = [name for name in dist.Backend.backend_list if name not in ("undefined", "fake")]
    # "cpu:gloo,cuda:nccl" names a backend per device type; torch checks each part itself.
    if isinstance(backend, str) and (backend.lower() in known or ":" in backend):
        return
    raise InvalidArgumentError(
        f"backend={backend!r} is not a torch.distributed backend.",
        hint=f"Use one of {', '.join(known)}, or leave it out: gpukit picks nccl when every "
        "process has a GPU, gloo otherwise.",
    )


def init(
    backend: str | None = None, *, timeout: datetime.timedelta | None = None
) -> DistributedContext:
    """Join the process group the launcher prepared, or return a one-process context.

    Reads the job from :func:`~gpukit.distributed.environment.environment` (torchrun, Slurm's
    ``srun``, Open MPI, SkyPilot), so ``srun python train.py`` needs nothing exported by hand;
    picks NCCL when this process sees a CUDA device, gloo otherwise; gives the process the
    device ``cuda:<local_rank>`` (``cuda:0`` when the scheduler bound each task to its own
    GPUs). A local rank beyond the GPUs this process sees fails at once with a
    :class:`~gpukit.errors.DistributedError` naming the variables. Without a launcher it starts
    nothing and returns rank 0 of 1 on ``gk.device("auto")``. Calling it again returns the
    same context.

    >>> init().world_size            # plain `python script.py`
    1
    """
    global _context
    _check_backend(backend)
    if _context is not None and (_context.distributed == dist.is_initialized()):
        return _context
    launch_env = environment()
    if dist.is_initialized():  # someone else set the group up: describe it, do not redo it
        group_backend = str(dist.get_backend())
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if group_backend == "nccl"
            else torch.device("cpu")
        )
        _context = DistributedContext(
            dist.get_rank(),
            launch_env.local_rank,
            dist.get_world_size(),
            launch_env.local_world_size,
            group_backend,
            dev,
        )
        return _context
    if not launch_env.launched:
        _context = DistributedContext(0, 0, 1, 1, None, _auto_device("auto"))
        return _context
    chosen, dev = _pick(launch_env, backend)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(
        chosen,
        init_method=_init_method(launch_env),
        rank=launch_env.rank,
        world_size=launch_env.world_size,
        **kwargs,
    )
    _context = DistributedContext(
        launch_env.rank,
        launch_env.local_rank,
        launch_env.world_size,
        launch_env.local_world_size,
        chosen,
        dev,
    )
    return _context


def _init_method(found: Environment) -> str:
    # torchrun's workers may share the agent's store, which only env:// knows how to find;
    # elsewhere the address and port come from the job, not from exported variables.
    if found.source == "torchrun":
        return "env://"
    host = found.master_addr or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{found.master_port}"


def _ready() -> DistributedContext:
    """The context, joining the group first when a launcher started us and nobody called init()."""
    return init()


def rank() -> int:
    """This process's global rank (0 when not launched distributed)."""
    return dist.get_rank() if dist.is_initialized() else environment().rank


def local_rank() -> int:
    """This process's rank on its machine, which is also its GPU index."""
    return environment().local_rank


def world_size() -> int:
    """How many processes take part in the run (1 when not launched distributed)."""
    return dist.get_world_size() if dist.is_initialized() else environment().world_size


def is_main() -> bool:
    """True on global rank 0: the process that prints, logs and saves checkpoints."""
    return rank() == 0


def barrier() -> None:
    """Wait until every process reaches this point (returns at once in a single process)."""
    ctx = _ready()
    if not ctx.distributed:
        return
    if ctx.device.type == "cuda":
        dist.barrier(device_ids=[ctx.device.index])
    else:
        dist.barrier()


def print_main(*objects: Any, **kwargs: Any) -> None:
    """``print`` on the main process only, so N processes do not print every line N times."""
    if is_main():
        print(*objects, **kwargs)


class _MainOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return is_main()


def get_logger(name: str) -> logging.Logger:
    """A ``logging`` logger whose records are kept on the main process and dropped elsewhere."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _MainOnly) for f in logger.filters):
        logger.addFilter(_MainOnly())
    return logger


def all_reduce_mean(x: torch.Tensor | float, *, weight: float | None = None) -> Any:
    """The mean of ``x`` over all processes: a tensor for a tensor, a float for a number.

    With ``weight``, the weighted mean ``sum(w * x) / sum(w)``: pass ``weight=len(batch)`` to
    get the loss one process computes on the whole global batch, exact in the last, uneven step
    of an epoch. A process with weight 0 (an empty batch, whose mean loss reads nan) counts for
    nothing. Every process must call it, empty batch or not.

    >>> all_reduce_mean(2.0)        # one process: its own value
    2.0
    >>> # dist.all_reduce_mean(loss, weight=len(x))            # the global batch's mean loss
    """
    if isinstance(x, bool) or not isinstance(x, (torch.Tensor, int, float)):
        raise InvalidArgumentError(
            f"all_reduce_mean takes a tensor or a number, not {type(x).__name__} ({x!r:.40}).",
            hint="Pass the value itself, e.g. all_reduce_mean(loss.item()) or all_reduce_mean(t).",
        )
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0
    ):
        raise InvalidArgumentError(
            f"all_reduce_mean(weight={weight!r}): a weight is a number of samples, 0 or more.",
            hint="Pass weight=len(batch), or leave it out for a plain mean over processes.",
        )
    ctx = _ready()
    is_number = not isinstance(x, torch.Tensor)
    tensor = torch.as_tensor(x, dtype=torch.float64 if is_number else None)
    if not tensor.is_floating_point():
        tensor = tensor.double()
    if ctx.distributed:
        origin = tensor.device
        work = tensor.detach().to(ctx.device, copy=True)
        if weight is None:
            dist.all_reduce(work, op=dist.ReduceOp.SUM)
            tensor = (work / ctx.world_size).to(origin)
        else:
            # One collective for the weighted values and the weights; a weight of 0 drops the
            # value itself, so the nan of a mean over no sample never reaches the sum.
            scaled = torch.zeros_like(work) if weight == 0 else work * weight
            packed = torch.cat([scaled.flatten(), work.new_tensor([float(weight)])])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
            tensor = (packed[:-1] / packed[-1]).reshape(work.shape).to(origin)
    return float(tensor) if is_number else tensor


def _gather_tensor(t: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    """All-gather ``t`` from every rank, concatenated along dim 0 (stacked when 0-d)."""
    origin = t.device
    work = t.detach().to(ctx.device)
    if work.dim() == 0:
        parts = [torch.empty_like(work) for _ in range(ctx.world_size)]
        dist.all_gather(parts, work)
        return torch.stack(parts).to(origin)
    # Ranks may hold different lengths (the last batch of a metric computed by hand): share the
    # lengths, pad to the longest, gather, then cut each part back.
    size = torch.tensor([work.shape[0]], device=ctx.device)
    sizes = [torch.empty_like(size) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, size)
    lengths = [int(s) for s in sizes]
    longest = max(lengths)
    if work.shape[0] < longest:
        pad = work.new_zeros((longest - work.shape[0], *work.shape[1:]))
        work = torch.cat([work, pad])
    parts = [torch.empty_like(work) for _ in range(ctx.world_size)]
    dist.all_gather(parts, work)
    return torch.cat([p[:n] for p, n in zip(parts, lengths, strict=True)]).to(origin)


Signature = tuple[str, tuple[int, ...] | None]


def _signature(leaf: Any) -> Signature:
    """What every rank must agree on for one leaf: a tensor's dtype and shape after dim 0."""
    if not isinstance(leaf, torch.Tensor):
        return type(leaf).__name__, None
    return str(leaf.dtype), (-1, *leaf.shape[1:]) if leaf.dim() else ()


def _describe(signature: Signature) -> str:
    kind, shape = signature
    if shape is None:
        return f"a {kind}"
    if not shape:
        return f"a 0-dim {kind} tensor"
    dims = ", ".join(["N", *map(str, shape[1:])])  # any number of rows
    return f"a {kind} tensor of shape ({dims})"


def _disagreement(shapes: list[dict[_tree.KeyPath, Signature]]) -> str | None:
    """How the ranks' structures differ, naming ranks and paths; None when they agree."""
    paths = [set(s) for s in shapes]
    everywhere = set.intersection(*paths)
    for rank, own in enumerate(paths):
        extra = sorted(own - everywhere, key=repr)
        if extra:
            lacking = [r for r, other in enumerate(paths) if extra[0] not in other]
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            return (
                f"rank {rank} has {_tree.format_path(extra[0], 'x')}{more}, which rank "
                f"{lacking[0]} does not"
            )
    for path in shapes[0]:
        seen = [s[path] for s in shapes]
        odd = next((r for r, sig in enumerate(seen) if sig != seen[0]), None)
        if odd is not None:
            return (
                f"{_tree.format_path(path, 'x')} is {_describe(seen[0])} on rank 0 but "
                f"{_describe(seen[odd])} on rank {odd}"
            )
    return None


def _gather_leaf(t: torch.Tensor, ctx: DistributedContext, keep: list[bool] | None) -> Any:
    gathered = _gather_tensor(t, ctx)
    if keep is None or t.dim() == 0:
        return gathered
    if gathered.shape[0] != len(keep):
        loader = active_loader()
        raise DistributedError(
            f"gather_for_metrics() got a tensor of {t.shape[0]} rows during a batch of "
            f"{loader.current_len if loader else '?'} samples, so it cannot tell which "
            "rows the sampler repeated.",
            hint="Gather per-sample values (one row per sample of the batch), or use "
            "all_reduce_mean for per-batch numbers.",
        )
    return gathered[torch.tensor(keep, device=gathered.device)]


def _gather_nested(x: Any, ctx: DistributedContext, keep: list[bool] | None) -> Any:
    leaves = dict(_tree.leaves_with_paths(x, None))
    signature = {path: _signature(leaf) for path, leaf in leaves.items()}
    # Every rank learns every rank's structure first: tensors are then paired by key path,
    # never by position, and a mismatch is an error on every rank instead of a hang or a
    # silently wrong pairing.
    shapes: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(shapes, signature)
    problem = _disagreement(shapes)
    if problem is not None:
        raise DistributedError(
            f"gather_for_metrics() was given different structures by the processes: {problem}.",
            hint="Pass the same keys, lengths and tensor shapes (but the number of rows) on "
            "every rank.",
        )
    for path, (kind, shape) in shapes[0].items():
        if shape is None:  # the same on every rank, as checked above
            raise DistributedError(
                f"gather_for_metrics() cannot gather {_tree.format_path(path, 'x')}, a {kind}.",
                hint="Pass tensors, or dicts, lists, tuples, namedtuples or dataclasses of "
                "them; turn numbers into tensors first (torch.tensor(value)).",
            )
    gathered = {path: _gather_leaf(leaves[path], ctx, keep) for path in shapes[0]}
    return _tree.map_with_paths(x, lambda path, _: gathered[path], torch.Tensor)


def gather_for_metrics(x: T) -> T:
    """All-gather per-sample values from every process, dropping the sampler's repeats.

    ``x`` is a tensor, or any nesting of them that ``gk.tree_map`` walks (dicts are paired
    by key, so ranks may build them in any order), with one row per sample of the current
    batch of a loader from :func:`prepare`. Ranks that pass different keys, lengths or tensor
    shapes get a :class:`~gpukit.errors.DistributedError` naming the ranks and the path.

    DistributedSampler repeats a few samples so that every process gets as many; those rows
    are removed here, so a metric over the gathered values counts each sample of the dataset
    exactly once. Outside such a loop it gathers
    everything, concatenated in rank order.
    """
    ctx = _ready()
    if not ctx.distributed or ctx.world_size == 1:
        return x
    loader = active_loader()
    keep = loader.kept_rows() if loader is not None else None
    gathered: T = _gather_nested(x, ctx, keep)
    return gathered


def _prepare_model(model: nn.Module, ctx: DistributedContext, ddp: Mapping[str, Any]) -> Any:
    if isinstance(model, DistributedDataParallel):
        return model
    model = to_device(model, ctx.device)
    if ctx.world_size == 1:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=ids, **ddp)
    # Shares of a global batch may differ (the last batch of an epoch): weigh each rank's
    # gradient by its samples, not by 1/N, so the step is the one a single process takes.
    wrapped.register_comm_hook(SampleWeights(ctx.world_size), weighted_allreduce)
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
def prepare(model: M) -> M | DistributedDataParallel: ...
@overload
def prepare(
    model: M,
    optimizer: Opt,
    loader: None = ...,
    *,
    per_device_batch_size: int | None = ...,
    global_batch_size: int | None = ...,
    seed: int = ...,
    ddp_kwargs: Mapping[str, Any] | None = ...,
) -> tuple[M | DistributedDataParallel, Opt]: ...
@overload
def prepare(
    model: M,
    optimizer: Opt,
    loader: DataLoader[Any],
    *,
    per_device_batch_size: int | None = ...,
    global_batch_size: int | None = ...,
    seed: int = ...,
    ddp_kwargs: Mapping[str, Any] | None = ...,
) -> tuple[M | DistributedDataParallel, Opt, DistributedLoader]: ...
@overload
def prepare(
    model: M,
    optimizer: None = ...,
    *,
    loader: DataLoader[Any],
    per_device_batch_size: int | None = ...,
    global_batch_size: int | None = ...,
    seed: int = ...,
    ddp_kwargs: Mapping[str, Any] | None = ...,
) -> tuple[M | DistributedDataParallel, DistributedLoader]: ...
@overload
def prepare(
    model: M,
    optimizer: None,
    loader: DataLoader[Any],
    *,
    per_device_batch_size: int | None = ...,
    global_batch_size: int | None = ...,
    seed: int = ...,
    ddp_kwargs: Mapping[str, Any] | None = ...,
) -> tuple[M | DistributedDataParallel, DistributedLoader]: ...
def prepare(
    model: nn.Module,
    optimizer: Optimizer | None = None,
    loader: DataLoader[Any] | None = None,
    *,
    per_device_batch_size: int | None = None,
    global_batch_size: int | None = None,
    seed: int = 0,
    ddp_kwargs: Mapping[str, Any] | None = None,
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

    >>> model, opt, loader = prepare(model, opt, loader, global_batch_size=64)  # doctest: +SKIP
    """
    _check_objects(model, optimizer, loader)
    ctx = _ready()
    out: list[Any] = [_prepare_model(model, ctx, ddp_kwargs or {})]
    if optimizer is not None:
        out.append(_prepare_optimizer(optimizer, ctx))
    if loader is not None:
        size = per_device_size(ctx.world_size, per_device_batch_size, global_batch_size)
        out.append(
            DistributedLoader(
                loader,
                batch_size=size,
                rank=ctx.rank,
                world_size=ctx.world_size,
                device=ctx.device,
                seed=seed,
            )
        )
    return out[0] if len(out) == 1 else tuple(out)
