"""Training jobs the sharding tests run in 1, 2 or 4 processes (module level: ranks import them).

The model has a stack of repeated blocks whose sizes no world size divides (7 rows: FSDP pads
the last rank's shard), a dataset of 97 samples in global batches of 8 (the last batch holds one
sample, so some ranks get none), and AdamW, whose moments amplify any difference in a step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist

SAMPLES = 97
GLOBAL_BATCH = 8
EPOCHS = 2


class Block(nn.Module):
    """One repeated layer of the stack, as a transformer repeats its blocks."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Stack(nn.Module):
    """An input layer, three blocks, an output layer."""

    def __init__(self, width: int = 7) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def data(samples: int = SAMPLES) -> TensorDataset:
    """Inputs and a noisy linear target, in float64."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 4, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)
    return TensorDataset(x, y + 0.1 * torch.randn(samples, 1, generator=gen, dtype=torch.float64))


def model() -> Stack:
    """The same float64 model in every process."""
    torch.manual_seed(0)
    return Stack().double()


def full_weights(net: nn.Module) -> dict[str, list[float]]:
    """Every parameter, whole (gathered where sharded), flattened: the same keys in any run."""
    out: dict[str, list[float]] = {}
    for name, param in net.named_parameters():
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out[name] = tensor.flatten().tolist()
    return out


def train(_rank: int = 0, shard: Any = True) -> dict[str, list[float]]:
    """Train with AdamW on GLOBAL_BATCH samples a step, whatever the world size; final weights."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    loader = DataLoader(data(), batch_size=GLOBAL_BATCH, shuffle=True)
    net, opt, loader = dist.prepare(
        net, opt, loader, global_batch_size=GLOBAL_BATCH, seed=7, shard=shard
    )
    for _ in range(EPOCHS):
        for x, y in loader:
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return full_weights(net)


def local_sizes(_rank: int = 0) -> dict[str, int]:
    """How many elements of each parameter this rank holds after prepare(..., shard=True)."""
    net = dist.prepare(model(), shard=True)
    return {name: p.to_local().numel() for name, p in net.named_parameters()}


def refusal_of_a_resumed_optimizer(_rank: int = 0) -> str:
    """The message prepare() gives for an optimizer that already holds moments."""
    net = model()
    opt = torch.optim.AdamW(net.parameters())
    net(torch.zeros(1, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    try:
        dist.prepare(net, opt, shard=True)
    except Exception as exc:  # the test checks the type by name: it crosses a process boundary
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bumped(net: nn.Module, by: float = 1.0) -> nn.Module:
    """Move every parameter by ``by``: weights no fresh model has, to tell a load happened."""
    with torch.no_grad():
        for param in net.parameters():
            param.add_(by)
    return net


def save_sharded(_rank: int, path: str, max_shard_size: Any = None) -> str:
    """Shard the bumped model over the group and gk.save it to ``path``."""
    import gpukit as gk

    net = bumped(dist.prepare(model(), shard=True))
    return str(gk.save(net, path, max_shard_size=max_shard_size))


def save_sharded_by_torch(_rank: int, path: str) -> str:
    """Shard the bumped model with torch's fully_shard itself (not gpukit) and gk.save it."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import gpukit as gk

    assert tdist.group.WORLD is not None
    mesh = DeviceMesh.from_group(tdist.group.WORLD, device_type="cpu")
    net = bumped(fully_shard(model(), mesh=mesh))
    return str(gk.save(net, path))


def load_sharded(_rank: int, path: str) -> dict[str, list[float]]:
    """gk.load ``path`` into a fresh model sharded over the group; its full weights."""
    import gpukit as gk

    net = dist.prepare(model(), shard=True)
    gk.load(net, path)
    return full_weights(net)


def save_training_state(_rank: int, path: str) -> str:
    """gk.save a dict of the sharded model, its AdamW after one step, and a step count."""
    import gpukit as gk

    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    net, opt = dist.prepare(net, opt, shard=True)
    x, y = data()[:8]
    nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    return str(gk.save({"model": net, "optimizer": opt, "step": 1}, path))


def load_error(_rank: int, path: str, width: int = 5) -> str:
    """The error gk.load gives loading ``path`` into a sharded model of another width."""
    import gpukit as gk

    torch.manual_seed(0)
    net = dist.prepare(Stack(width).double(), shard=True)
    try:
        gk.load(net, path)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def save_error(_rank: int, path: str, max_shard_size: Any = None) -> str:
    """The error gk.save gives for a sharded model saved where it may not write."""
    import gpukit as gk

    net = dist.prepare(model(), shard=True)
    try:
        gk.save(net, path, max_shard_size=max_shard_size)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def four_processes(_: Any, folder: str, sharded_state: str, unsharded_state: str) -> dict[str, Any]:
    """In each of four processes: load a DCP folder two processes saved, and finish the runs
    whose training states two sharded processes and one process saved."""
    return {
        "loaded": load_sharded(0, folder),
        "from_two": run_with_state(0, sharded_state)["weights"],
        "from_one": run_with_state(0, unsharded_state)["weights"],
    }


def sharded_only(_rank: int) -> str:
    """Shard the model with the other ranks, then do nothing more: the rank that skips a save
    ``if dist.is_main():`` keeps to rank 0."""
    dist.prepare(model(), shard=True)
    return "sharded"


def gk_save_failing_on_rank_1(rank: int, path: str) -> str:
    """gk.save of a sharded model to a DCP folder whose rank 1 cannot write its part (a full
    disk): the error each rank gets."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    import gpukit as gk

    net = dist.prepare(model(), shard=True)

    def full(*_: Any, **__: Any) -> Any:
        raise OSError(28, "No space left on device")

    with mock.patch.object(FileSystemWriter, "write_data", full) if rank == 1 else nullcontext():
        try:
            gk.save(net, path)
        except (Exception, CheckpointException) as exc:  # torch's is a BaseException
            return f"{type(exc).__name__}: {exc}"
    return "no error"


def in_four_processes(*args: str) -> dict[str, Any]:
    """Run ``tests/train/shard_four.py args...`` (a job of four processes launched by a process
    of its own, one thread each) and return what it printed."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "src")]))
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(root / "tests/train/shard_four.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def cuda_bytes_after_prepare(_: Any = None) -> dict[str, Any]:
    """On a GPU process: the CUDA bytes the sharded model holds, and where its rows live."""
    big = nn.Sequential(*(Block(1024) for _ in range(4)))  # 16 MiB of float32 parameters
    net = dist.prepare(big, shard=True)
    torch.cuda.synchronize()
    local = next(iter(net.parameters())).to_local()
    return {"allocated": torch.cuda.memory_allocated(), "device": str(local.device)}


def train_accumulating(
    _rank: int = 0, shard: Any = True, accumulate: int = 2
) -> dict[str, list[float]]:
    """Train with AdamW in micro-batches, ending each with dist.step(loss); final weights."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    loader = DataLoader(data(), batch_size=GLOBAL_BATCH, shuffle=True)
    net, opt, loader = dist.prepare(
        net,
        opt,
        loader,
        global_batch_size=GLOBAL_BATCH,
        accumulate=accumulate,
        seed=7,
        shard=shard,
    )
    for _ in range(EPOCHS):
        for x, y in loader:
            dist.step(nn.functional.mse_loss(net(x), y))
    return full_weights(net)


def train_with_training_state(_rank: int, folder: str) -> dict[str, list[float]]:
    """One run trains an epoch sharded and saves a gk.TrainingState; a new run resumes it."""
    import gpukit as gk

    def run() -> dict[str, list[float]]:
        net = model()
        opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
        loader = DataLoader(data(), batch_size=GLOBAL_BATCH, shuffle=True)
        net, opt, loader = dist.prepare(
            net, opt, loader, global_batch_size=GLOBAL_BATCH, seed=7, shard=True
        )
        with gk.TrainingState(
            folder, model=net, optimizer=opt, loader=loader, asynchronous=False
        ) as state:
            resumed = state.resume()
            for x, y in loader:  # one epoch: the first, or the one after the save
                loss = nn.functional.mse_loss(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()  # counted: state.step
            if resumed is None:
                state.save()
        return full_weights(net)

    run()  # stops after its first epoch, as a job that ran out of time
    return run()


STOP = 5
"""The steps a run interrupted by the tests below takes before its save: inside the first
epoch, so the loader's position inside an epoch is saved too."""


def _prepared(shard: Any = True) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    loader = DataLoader(data(), batch_size=GLOBAL_BATCH, shuffle=True)
    return dist.prepare(net, opt, loader, global_batch_size=GLOBAL_BATCH, seed=7, shard=shard)


def run_with_state(
    _rank: int, folder: str, stop: int | None = None, shard: Any = True
) -> dict[str, Any]:
    """:func:`train` through a gk.TrainingState in ``folder``: resume what is there; with
    ``stop``, save (asynchronously) after that many steps and stop there, as a job that ran
    out of time. Its full weights, the largest tensor (elements, a DTensor's local part) this
    process made while ``save()`` ran, and each file it fsynced while saving, with when."""
    import gpukit as gk

    net, opt, loader = _prepared(shard)
    largest = 0
    fsyncs: list[tuple[int, str]] = []
    with gk.TrainingState(folder, model=net, optimizer=opt, loader=loader) as state:
        state.resume()
        for _ in range(loader.epoch, EPOCHS):
            for x, y in loader:
                loss = nn.functional.mse_loss(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()  # counted: state.step
                if state.step == stop:
                    with _LargestTensor() as seen, _fsyncs_noted(fsyncs):
                        state.save()
                        state.wait()  # the writer thread's fsyncs too
                    largest = seen.largest
                    break
            if state.step == stop:
                break
    return {"weights": full_weights(net), "largest": largest, "fsyncs": fsyncs}


@contextmanager
def _fsyncs_noted(found: list[tuple[int, str]]) -> Iterator[None]:
    """Note each fsync of this process (every thread): the system's monotonic clock, which
    orders the processes of one machine, and the path fsynced."""
    real = os.fsync

    def fsync(fd: Any) -> None:
        real(fd)
        number = fd if isinstance(fd, int) else fd.fileno()
        found.append((time.monotonic_ns(), os.readlink(f"/proc/self/fd/{number}")))

    with mock.patch.object(os, "fsync", fsync):
        yield


class _LargestTensor(TorchDispatchMode):
    """Notes the most elements of any floating-point tensor an operation makes (a DTensor's: its
    local part); the random streams' byte states are not the model's."""

    largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                local = getattr(value, "_local_tensor", value)
                self.largest = max(self.largest, local.numel())
        return out


def resume_error(_rank: int, folder: str) -> str:
    """The error a sharded run gets resuming from ``folder``."""
    import gpukit as gk

    net, opt, loader = _prepared()
    try:
        with gk.TrainingState(folder, model=net, optimizer=opt, loader=loader) as state:
            state.resume()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _local_state(net: nn.Module, opt: torch.optim.Optimizer) -> list[list[float]]:
    """This rank's rows of every weight and of AdamW's moments, in a fixed order."""
    rows = [p.to_local().flatten().tolist() for p in net.parameters()]  # type: ignore[operator]
    for param in net.parameters():
        for name in ("exp_avg", "exp_avg_sq"):
            rows.append(opt.state[param][name].to_local().flatten().tolist())
    return rows


def change_after_saving(_rank: int, folder: str) -> dict[str, Any]:
    """Save asynchronously after STOP steps, change every weight and moment in place before
    the save is written, then resume into fresh objects: this rank's state at the save, and
    the state resumed."""
    import threading

    import gpukit as gk

    net, opt, loader = _prepared()
    for step, (x, y) in enumerate(loader, start=1):
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == STOP:
            break
    at_save = _local_state(net, opt)
    with gk.TrainingState(folder, model=net, optimizer=opt, loader=loader) as state:
        # The writer thread waits behind this gate: what the loop changes next reaches the
        # save unless save() copied the shards before it returned.
        gate = threading.Event()
        state._writer.submit(gate.wait)
        state.save()
        with torch.no_grad():
            for param in net.parameters():
                param.add_(100.0)
                opt.state[param]["exp_avg"].add_(100.0)
        gate.set()
    net, opt, loader = _prepared()
    with gk.TrainingState(folder, model=net, optimizer=opt, loader=loader) as state:
        state.resume()
    return {"at_save": at_save, "resumed": _local_state(net, opt)}


def save_failing_on_rank_1(rank: int, folder: str) -> str:
    """A sharded save whose rank 1 cannot write its shards (a full disk): the error each rank
    gets from waiting for it."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    import gpukit as gk

    net, opt, loader = _prepared()

    def full(*_: Any, **__: Any) -> Any:
        raise OSError(28, "No space left on device")

    with mock.patch.object(FileSystemWriter, "write_data", full) if rank == 1 else nullcontext():
        state = gk.TrainingState(folder, model=net, optimizer=opt, loader=loader)
        try:
            state.save()
            state.wait()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            state._writer.shutdown(wait=True)
    return "no error"
