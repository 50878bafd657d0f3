"""One rank of the fault matrix's training run, with the faults it can be told to suffer.

A tiny float64 run (bitwise comparable across restarts) that resumes from the newest complete
save in its folder, trains to the end or to ``stop_at``, saves every ``SAVE_EVERY`` steps with
``gk.TrainingState`` (asynchronous, ``keep`` saves), reads its data through a
``DistributedLoader`` with a forked DataLoader worker, and stops on SIGUSR1/SIGTERM through
``gk.train.Preemption`` (exit 75). A *plan* (plain JSON) says what fault this rank meets:

- ``kill``: ``{"rank", "how": "timer", "step", "delay", "target"}`` kills with SIGKILL, ``delay``
  seconds after step ``step`` started, this rank (``self``), its DataLoader worker
  (``worker``), its launcher (``parent``: torchrun's agent) or ``gpukit run`` (``grandparent``);
  ``{"rank", "how": "point", "point", "step", "offset"}`` kills this rank at a named point of the
  save of step ``step`` (or of the resume): the library is wrapped here, never changed.
- ``signal``: ``{"rank", "step", "delay", "again", "signum"}`` sends the signal to this rank
  twice, ``delay`` and ``delay + again`` seconds after step ``step`` started.

It reports what happened as lines appended to ``<report>/events-<rank>`` (``resumed``,
``saved``, ``complete``, ``preempted``, ``error``) and writes its final weights and the save it
resumed to ``<report>/result-<rank>.json``.

Run as ``python fault_workload.py PLAN.json`` under torchrun (``gpukit run --ddp``), or as
``python fault_workload.py --zygote``: a process that imports torch once and forks a rank per
request read on stdin (one JSON line each), reporting ``{"tag", "pid"}`` when it forked and
``{"tag", "pid", "status"}`` when that rank ended, so that a run costs a fork, not a start of
Python and torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import gpukit.train._staging as staging
import gpukit.train._writing as writing
import gpukit.train.saves as saves
from gpukit import distributed as dist
from gpukit.errors import GpukitError
from gpukit.train import Preemption, TrainingState

SAMPLES = 43  # 7 global batches of 6 and one of 1 per epoch
GLOBAL_BATCH = 6
EPOCHS = 2
STEPS = EPOCHS * 8
SAVE_EVERY = 3
SAVE_STEPS = tuple(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
GROUP_TIMEOUT = timedelta(seconds=60)  # a rank left alone fails instead of waiting for ever

# The named points of a save (and of a resume) where a rank can be killed.
SAVE_POINTS = (
    "stage",  # copying the state to host memory, in the loop's thread
    "write",  # part-way through writing a file of the save (at ``offset`` bytes)
    "fsync",  # the fsync of the save's folder after a file
    "digest",  # digesting the files written
    "meet",  # before the ranks' meeting (all parts on disk?)
    "marker",  # part-way through writing COMPLETE.json, before its rename
    "marked",  # after COMPLETE.json is in place, before the run's folder is fsynced
    "prune",  # removing an old save: after its marker went, before its files
)
RESUME_POINTS = ("newest", "load")


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A float64 regression set."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, 4, generator=gen, dtype=torch.float64)
        noise = 0.1 * torch.randn(SAMPLES, 1, generator=gen, dtype=torch.float64)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + noise

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Noise:
    """A rank's own extra that draws from NumPy and Python each step, so both streams matter."""

    def __init__(self) -> None:
        self.total = 0.0

    def draw(self) -> float:
        self.total += float(np.random.rand()) + random.random()
        return self.total

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = state["total"]


class Reporter:
    """Lines appended to this rank's events file: each one a single write, so whole."""

    def __init__(self, folder: str, rank: int) -> None:
        self.fd = os.open(
            os.path.join(folder, f"events-{rank}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND
        )

    def __call__(self, *words: object) -> None:
        os.write(self.fd, (" ".join(str(w) for w in words) + "\n").encode())


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _die() -> None:
    """SIGKILL this process, as kill -9 from outside would."""
    os.kill(os.getpid(), signal.SIGKILL)


def _step_of(folder: Path) -> int:
    """The step in a save folder's name (``step-<step>-<token>-<count>``)."""
    return int(folder.name.split("-")[1])


class _Killer:
    """Kills at a moment of a step: a timer started when the step starts."""

    def __init__(self, plan: dict[str, Any] | None, rank: int) -> None:
        self.plan = plan if plan is not None and plan.get("rank") == rank else None

    def step_started(self, step: int) -> None:
        plan = self.plan
        if plan is None or plan["step"] != step:
            return
        timer = threading.Timer(plan["delay"], self._fire, args=(plan["target"],))
        timer.daemon = True
        timer.start()

    @staticmethod
    def _fire(target: str) -> None:
        import psutil

        me = psutil.Process()
        if target == "worker":
            workers = me.children()
            if workers:  # between epochs there is none: then the rank goes
                _kill(workers[0].pid)
                return
            _die()
        elif target == "parent":
            _kill(os.getppid())
        elif target == "grandparent":
            parent = me.parent()
            grand = parent.parent() if parent is not None else None
            if grand is not None:
                _kill(grand.pid)
        else:
            _die()


class _Signaller:
    """Sends a stop signal to this rank twice, at a moment of a step."""

    def __init__(self, plan: dict[str, Any] | None, rank: int) -> None:
        self.plan = plan if plan is not None and plan.get("rank") == rank else None

    def step_started(self, step: int) -> None:
        plan = self.plan
        if plan is None or plan["step"] != step:
            return
        for delay in (plan["delay"], plan["delay"] + plan["again"]):
            timer = threading.Timer(delay, os.kill, args=(os.getpid(), plan["signum"]))
            timer.daemon = True
            timer.start()


class _Writer:
    """A file handle that kills this process once ``limit`` bytes went through it."""

    def __init__(self, handle: Any, limit: int) -> None:
        self._handle = handle
        self._left = limit

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= self._left:
            self._handle.write(view[: self._left])
            self._handle.flush()
            _die()
        self._left -= len(view)
        return int(self._handle.write(view))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def install_point(plan: dict[str, Any] | None, rank: int, current: list[int]) -> None:
    """Wrap the save's (or resume's) functions so that this rank dies at the planned point.

    ``current`` holds the step the loop is at (for the staging copy, which has no folder).
    """
    if plan is None or plan.get("how") != "point" or plan.get("rank") != rank:
        return
    point, step, offset = plan["point"], plan.get("step"), plan.get("offset", 0)

    def here(folder: Path) -> bool:
        return _step_of(folder) == step

    if point == "stage":
        stage = staging.Stager.stage

        def staged(self: staging.Stager, state: Any) -> Any:
            if current[0] == step:
                _die()
            return stage(self, state)

        staging.Stager.stage = staged  # type: ignore[method-assign]
    elif point == "write":
        write_part = saves.write_part

        def part(folder: Path, name: str, write: Callable[[Any], object]) -> None:
            if here(folder):
                return write_part(folder, name, lambda handle: write(_Writer(handle, offset)))
            return write_part(folder, name, write)

        saves.write_part = part
    elif point == "fsync":
        fsync_folder = saves.fsync_folder

        def fsync(folder: Path) -> None:
            if folder.name.startswith("step-") and here(folder):
                _die()
            fsync_folder(folder)

        saves.fsync_folder = fsync
    elif point == "digest":
        # Wherever the save's writing finds its digest function (the module may move).
        for module in (writing, saves):
            digest = getattr(module, "digest", None)
            if digest is not None:
                module.digest = _dying_digest(digest, here)  # type: ignore[attr-defined]
    elif point == "meet":
        meet = writing.SaveJob._meet

        def met(self: writing.SaveJob, *args: Any) -> Any:
            if here(self.folder):
                _die()
            return meet(self, *args)

        writing.SaveJob._meet = met  # type: ignore[method-assign]
    elif point in ("marker", "marked"):
        atomic_write = saves.atomic_write

        def marked(target: Path, write: Callable[[Any, Path], None]) -> None:
            if not here(target.parent):
                return atomic_write(target, write)
            if point == "marker":
                return atomic_write(target, lambda handle, tmp: write(_Writer(handle, offset), tmp))
            atomic_write(target, write)
            _die()

        saves.atomic_write = marked
    elif point == "prune":
        rmtree, prune = shutil.rmtree, saves.prune
        pruning = [False]

        def pruned(root: Path, *, keep: int, current: Path) -> list[Path]:
            pruning[0] = here(current)  # the prune that follows the save of ``step``
            return prune(root, keep=keep, current=current)

        def half(path: Any, *args: Any, **kwargs: Any) -> None:
            if pruning[0] and Path(path).name.startswith("step-"):
                files = sorted(Path(path).iterdir())
                for file in files[: offset % (len(files) + 1)]:
                    file.unlink()
                _die()
            rmtree(path, *args, **kwargs)

        shutil.rmtree = half  # type: ignore[assignment]
        saves.prune = pruned
    elif point == "newest":
        newest = saves.newest

        def chosen(root: Path) -> Any:
            found = newest(root)
            _die()
            return found

        saves.newest = chosen
    elif point == "load":
        load_part = saves.load_part
        calls = [0]

        def loaded(folder: Path, name: str) -> Any:
            calls[0] += 1
            if calls[0] > offset % 2:
                _die()
            return load_part(folder, name)

        saves.load_part = loaded
    else:
        raise ValueError(f"no such point {point!r}")


def _dying_digest(
    digest: Callable[[Path], str], here: Callable[[Path], bool]
) -> Callable[[Path], str]:
    def digested(path: Path) -> str:
        if here(path.parent):
            _die()
        return digest(path)

    return digested


def _report_completion(report: Reporter) -> None:
    """Wrap ``saves.finish`` so that rank 0 says ``complete STEP`` once a save is marked."""
    finish = saves.finish

    def finished(folder: Path, **kwargs: Any) -> None:
        finish(folder, **kwargs)
        report("complete", kwargs["step"], folder.name)

    saves.finish = finished


def _weights(model: nn.Module) -> bytes:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    flat = torch.cat([p.detach().flatten() for p in inner.parameters()])
    return bytes(flat.numpy().tobytes())


def train(plan: dict[str, Any], rank: int) -> int:
    """Resume, train to the end (or die at ``stop_at``), with the planned fault; an exit code.

    0: the run ended (its weights are written); 75: preempted; 1: an error (reported with its
    type, and whether it is one of gpukit's).
    """
    report = Reporter(plan["report"], rank)
    current = [0]
    install_point(plan.get("kill"), rank, current)
    _report_completion(report)
    killer = _Killer(
        plan.get("kill") if (plan.get("kill") or {}).get("how") == "timer" else None, rank
    )
    signaller = _Signaller(plan.get("signal"), rank)
    torch.use_deterministic_algorithms(True)
    seed = 100 + rank
    np.random.seed(seed)
    random.seed(seed)
    torch.manual_seed(0)  # the same initial weights on every rank
    model: nn.Module = nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1)
    ).double()
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    workers = int(plan.get("workers", 1))
    loader = DataLoader(
        Samples(),
        batch_size=GLOBAL_BATCH,
        shuffle=True,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )
    model, opt, loader = dist.prepare(model, opt, loader, global_batch_size=GLOBAL_BATCH, seed=7)
    drawn = Noise()
    state = TrainingState(
        plan["folder"],
        model=model,
        optimizer=opt,
        scheduler=sched,
        loader=loader,
        rank_extras={"noise": drawn},
        keep=int(plan.get("keep", 2)),
    )
    stop_at = plan.get("stop_at")
    save_every = int(plan.get("save_every", SAVE_EVERY))
    try:
        with state, Preemption(env={}) as preemption:
            resumed = state.resume()
            report(
                "resumed",
                "-" if resumed is None else resumed.path.name,
                "-" if resumed is None else resumed.step,
                0 if resumed is None else len(resumed.passed_over),
            )
            for _ in range(loader.epoch, EPOCHS):
                for x, y in loader:
                    current[0] = state.step + 1
                    killer.step_started(current[0])
                    signaller.step_started(current[0])
                    loss = nn.functional.mse_loss(model(x), y) * (1 + 1e-3 * drawn.draw())
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    sched.step()  # state.step counted the optimizer's step itself
                    if state.step == stop_at:
                        return 0  # dies here, after waiting for its last save
                    if state.step % save_every == 0:
                        state.save()
                        report("saved", state.step)
                    if preemption.should_stop():
                        report("preempted", state.step)
                        preemption.stop(state)
        result = {"weights": _weights(model).hex(), "step": state.step}
        # Written aside, then renamed: a kill landing mid-write leaves no half-written result.
        written = Path(plan["report"], f".result-{rank}.json.tmp")
        written.write_text(json.dumps(result))
        os.replace(written, Path(plan["report"], f"result-{rank}.json"))
        return 0
    except SystemExit as stopped:  # Preempted: the state is saved
        return int(stopped.code or 0)
    except BaseException as exc:
        typed = isinstance(exc, GpukitError)
        line = str(exc).splitlines()[0] if str(exc) else ""
        report("error", "typed" if typed else "untyped", type(exc).__name__, line[:300])
        return 1


def run_rank(plan: dict[str, Any], rank: int, world: int, store: str | None) -> int:
    """Join the group (through a file store) when ``world`` > 1, then :func:`train`."""
    if world > 1:
        if store is None:  # launched by torchrun: its environment says where to meet
            torch_dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
        else:
            torch_dist.init_process_group(
                "gloo",
                init_method=f"file://{store}",
                rank=rank,
                world_size=world,
                timeout=GROUP_TIMEOUT,
            )
    return train(plan, rank)


def _forked(request: dict[str, Any]) -> None:
    """The child's side of a fork: run the rank, never return into the zygote's loop."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a kill of the group takes its loader workers too
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        log = os.open(
            os.path.join(request["plan"]["report"], f"log-{request['rank']}"),
            os.O_WRONLY | os.O_CREAT | os.O_APPEND,
        )
        os.dup2(log, 1)
        os.dup2(log, 2)
        code = run_rank(request["plan"], request["rank"], request["world"], request["store"])
    finally:
        os._exit(code)


def zygote() -> None:
    """Fork a rank per request line on stdin; say on stdout when each starts and ends."""
    torch.set_num_threads(1)  # no thread pool in the parent of every fork
    out = sys.stdout
    running: dict[int, str] = {}
    pending = b""
    open_input = True
    while open_input or running:
        # Raw reads: a buffered reader could hold a second request that select() never sees.
        ready, _, _ = select.select([0] if open_input else [], [], [], 0.005)
        if ready:
            chunk = os.read(0, 1 << 16)
            open_input = bool(chunk)
            pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _forked(request)
            running[pid] = request["tag"]
            out.write(json.dumps({"tag": request["tag"], "pid": pid}) + "\n")
            out.flush()
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            tag = running.pop(pid, None)
            if tag is not None:
                code = os.waitstatus_to_exitcode(status)
                out.write(json.dumps({"tag": tag, "pid": pid, "status": code}) + "\n")
                out.flush()


def main() -> None:
    """``--zygote``, or one rank of a torchrun job with the plan in the file named."""
    if sys.argv[1:] == ["--zygote"]:
        zygote()
        return
    plan = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    code = run_rank(plan, rank, world, None)
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: a killed peer's sockets must not hang it


if __name__ == "__main__":
    main()
