"""The process group: join it, ask who this process is, and prepare a model and data for it.

Process groups and rendezvous are torch.distributed's and torchrun's; this module only reads
their environment, picks the backend and device, and wires the model and data.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

# Imported here, before any group exists: torch.distributed.nn takes the default group of the
# moment it is first imported as its functions' default argument, and DistributedDataParallel
# imports it (through torch._dynamo). Imported after init(), it would hold the group to the end.
import torch.distributed.nn
from torch import nn
from torch.optim import Optimizer

from gpukit.devices import device as _auto_device
from gpukit.distributed.environment import Environment, check_local_ranks_fit, environment
from gpukit.errors import DistributedError, GpukitError, InvalidArgumentError

T = TypeVar("T")
M = TypeVar("M", bound=nn.Module)
Opt = TypeVar("Opt", bound=Optimizer)

__all__ = [
    "DistributedContext",
    "barrier",
    "get_logger",
    "init",
    "is_main",
    "local_rank",
    "print_main",
    "rank",
    "world_size",
]


@dataclass(frozen=True)
class DistributedContext:
    """This process's place in the run: ranks, backend (None when single) and its device.

    Args:
        rank: this process's global rank, 0 to ``world_size - 1``.
        local_rank: its rank among the processes of its node.
        world_size: how many processes the run has, 1 or more.
        local_world_size: how many of them run on this node.
        backend: the process group's backend (``"nccl"``, ``"gloo"``); None: a single process.
        device: the device this process trains on (``cuda:<local GPU>``, or the CPU).
    """

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
    check_local_ranks_fit(found, count, "CUDA (torch.cuda.device_count())")
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
    same context. A group it joined is left when the process exits, so a script need not call
    ``destroy_process_group``.

    >>> init().world_size            # plain `python script.py`
    1

    Args:
        backend: "nccl", "gloo" (or "cpu:gloo,cuda:nccl"); None: NCCL where this process
            sees a GPU, gloo otherwise.
        timeout: how long a collective may wait for the other ranks; None: torch's default.
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
    _refusals_in_one_line()
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
    atexit.register(_leave)  # before the interpreter's teardown: see _leave
    _context = DistributedContext(
        launch_env.rank,
        launch_env.local_rank,
        launch_env.world_size,
        launch_env.local_world_size,
        chosen,
        dev,
    )
    return _context


def _refusals_in_one_line() -> None:
    """Have an uncaught gpukit error end this launched process with one line, not a traceback.

    A refusal (a batch the processes cannot split, a save that cannot be resumed here) is
    raised on every rank alike: its message and hint say what to do, and W tracebacks of it
    buried them. Any other exception keeps its traceback, and ``GPUKIT_TRACEBACK=1`` gives
    gpukit's errors theirs back.
    """
    previous = sys.excepthook
    if getattr(previous, "gpukit_one_line", False):
        return

    def one_line(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, GpukitError) and os.environ.get("GPUKIT_TRACEBACK", "") in ("", "0"):
            # torchrun and srun --label put the rank before each line of a worker's output.
            print(f"gpukit: {kind.__name__}: {value}", file=sys.stderr, flush=True)
            return
        previous(kind, value, tb)

    one_line.gpukit_one_line = True  # type: ignore[attr-defined]
    sys.excepthook = one_line


# The DistributedDataParallel wrappers prepare() made, let go of the group when it is left.
_wrappers: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _leave_with_the_group(wrapper: nn.Module) -> None:
    """Have ``wrapper`` (a DistributedDataParallel) let go of the group when gpukit leaves it."""
    _wrappers.add(wrapper)


def _leave() -> None:
    if dist.is_initialized():
        # Whatever still holds the group at exit (a model kept by reference cycles, or by the
        # script's globals) would free it during interpreter teardown, with the group's threads
        # still running, which can abort a process that finished its work ("terminate called
        # without an active exception"). Let go of it now, while Python is whole.
        gc.collect()
        for wrapper in list(_wrappers):
            for held in ("reducer", "logger", "process_group"):  # the group is gone with them
                setattr(wrapper, held, None)
        dist.destroy_process_group()


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
    """``print`` on the main process only, so N processes do not print every line N times.

    Args:
        *objects: what to print, as ``print`` takes it.
        **kwargs: ``print``'s options (``sep``, ``end``, ``file``, ``flush``).
    """
    if is_main():
        print(*objects, **kwargs)


class _MainOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return is_main()


def get_logger(name: str) -> logging.Logger:
    """A ``logging`` logger whose records are kept on the main process and dropped elsewhere.

    Args:
        name: the logger's name, as ``logging.getLogger`` takes it.
    """
    logger = logging.getLogger(name)
    if not any(isinstance(f, _MainOnly) for f in logger.filters):
        logger.addFilter(_MainOnly())
    return logger
