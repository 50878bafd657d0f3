"""Faults injected into a two-process training run; every run resumed to its end and compared.

    python benchmarks/bench_faults.py --faults 1000 --seed 0 --out results.json
    python benchmarks/bench_faults.py --faults 30                  # the quick form

The run (``tests/train/scripts/fault_workload.py``) is a tiny float64 model on 2 gloo processes
(CPU), saved every 3 of its 24 steps by ``gk.TrainingState`` (asynchronous, ``keep=2``), fed by a
``DistributedLoader`` with one forked DataLoader worker, stopped by ``gk.train.Preemption``. Each
fault is drawn at random (seeded) from :data:`MIX`; after it the run is resumed to its end, on 2
processes (on 1 for some) and its final weights compared bitwise (``torch.equal``) with a run
never interrupted: for a resume on 2 processes the whole run; for a resume on 1 process, that
one process resumed from the intact save of the same step (a run's weights depend on its
number of processes; given the same save, the result is exact).

What is recorded for each fault: how the resumed run ended (bitwise equal, different weights:
a silent divergence, a typed gpukit error, an untyped error, a hang), which save it took
(``Resumed.path``) and whether that save was torn or damaged (its files compared with the
uninterrupted run's save of that step, byte for byte), whether saves were lost beyond the
last complete one (the resume took an older save than the newest intact complete one, or a
save reported complete before the fault is gone), and the processes left behind (this process
is the reaper of orphans, ``PR_SET_CHILD_SUBREAPER``; a process still alive
:data:`LINGER_S` seconds after its run ended is left behind, then killed).

Ranks are forked from a *zygote* that imported torch once, so a run costs a fork (real
processes, killed for real); faults through ``gpukit run --ddp --cpu-ok`` start the whole
chain (gpukit, torchrun's agent, two workers) each time. Damage faults (a byte flipped in
place, a file cut short, a file removed) need no kill: the saves of the uninterrupted run are
copied, damaged, and resumed. A full disk is a real tmpfs mounted per fault (root only; its
size chosen at random, so the disk fills at a random page of a save); a read-only folder is
a tmpfs remounted read-only. Without root both kinds are left out and said so.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "tests" / "train" / "scripts" / "fault_workload.py"
sys.path.insert(0, str(WORKLOAD.parent))

import fault_workload as workload  # noqa: E402  (the rank's module: its points, its steps)

# kind -> share of the faults drawn. Damage faults are cheap (no process is killed); the rest
# start real processes and kill or signal them.
MIX: dict[str, float] = {
    "flip": 0.32,  # one byte of one file of a save XORed with a random non-zero mask
    "truncate": 0.15,  # one file of a save cut at a random length
    "remove": 0.155,  # one file of a save removed
    "kill_step": 0.07,  # SIGKILL of one rank at a random moment of a random step
    "kill_save": 0.13,  # SIGKILL of one rank at a named point of a save (workload.SAVE_POINTS)
    "kill_resume": 0.03,  # SIGKILL of one rank while it resumes
    "kill_worker": 0.03,  # SIGKILL of a rank's DataLoader worker
    "signal": 0.05,  # SIGUSR1 or SIGTERM, twice, to one rank
    "disk_full": 0.03,  # the run's folder on a tmpfs too small for the run (real ENOSPC)
    "read_only": 0.02,  # the run's folder made read-only before its next save
    "launcher": 0.015,  # `gpukit run --ddp`: kill -9 of gpukit, of torchrun, of a rank; a signal
}
ONE_PROCESS_SHARE = 0.25  # of the faults whose resume may run on 1 process instead of 2
ROOT_ONLY = ("disk_full", "read_only")
RUN_BOUND_S = 90.0  # a forked run longer than this is a hang (a whole run takes about 2 s)
LAUNCHER_BOUND_S = 180.0  # the same through gpukit run (about 12 s)
LINGER_S = 20.0  # a process still alive this long after its run ended is left behind
PAGE = 4096
PREEMPTED = 75  # a rank's exit once gk.train.Preemption has saved (PREEMPTED_EXIT_CODE)


@dataclass(frozen=True)
class Fault:
    """One fault to inject: its kind, what exactly, and on how many processes to resume."""

    index: int
    kind: str
    resume_world: int
    params: dict[str, Any]


@dataclass
class Record:
    """What became of one fault."""

    index: int
    kind: str
    params: dict[str, Any]
    resume_world: int
    outcome: str = ""
    """equal | diverged | typed_error | untyped_error | hang"""
    resumed: str | None = None
    resumed_step: int | None = None
    expected_step: int | None = None
    damaged_load: bool = False
    lost: bool = False
    left_behind: int = 0
    fault_exit: dict[str, int | None] = field(default_factory=dict)
    fault_errors: list[str] = field(default_factory=list)
    passed_over: int = 0
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class RunResult:
    """One run of the ranks: exit codes (None: killed by the bound), events, final weights."""

    codes: dict[int, int | None]
    hung: bool
    events: dict[int, list[list[str]]]
    weights: dict[int, bytes]
    seconds: float

    def said(self, word: str) -> list[list[str]]:
        """Every event line (after the word) that any rank reported with ``word``."""
        return [line[1:] for lines in self.events.values() for line in lines if line[0] == word]


# --- the plan -----------------------------------------------------------------------------------


def plan_faults(
    count: int, seed: int, mix: dict[str, float] | None = None, *, can_mount: bool = True
) -> list[Fault]:
    """``count`` faults drawn from ``mix`` (kinds that need root left out without it)."""
    weights = dict(MIX if mix is None else mix)
    if not can_mount:
        for kind in ROOT_ONLY:
            weights.pop(kind, None)
    rng = random.Random(seed)
    kinds = list(weights)
    # Every kind once as far as ``count`` allows, the rest drawn by the weights.
    chosen = sorted(kinds, key=lambda k: -weights[k])[: min(count, len(kinds))]
    chosen += rng.choices(kinds, [weights[k] for k in kinds], k=count - len(chosen))
    rng.shuffle(chosen)
    return [_fault(i, kind, rng) for i, kind in enumerate(chosen)]


def _fault(index: int, kind: str, rng: random.Random) -> Fault:
    steps, saves_at = workload.STEPS, workload.SAVE_STEPS
    params: dict[str, Any] = {}
    world = 2
    if kind in ("flip", "truncate", "remove"):
        newest = rng.choice(saves_at[1:-1])  # a folder holding the saves newest-3 and newest
        params = {
            "newest": newest,
            "save": rng.choice((newest - workload.SAVE_EVERY, newest)),
            "file": rng.choice(("shared.pt", "rank-00000.pt", "rank-00001.pt", "COMPLETE.json")),
            "at": rng.random(),  # where in the file, as a share of its length
            "mask": rng.randrange(1, 256),
        }
        world = 1 if rng.random() < ONE_PROCESS_SHARE else 2
    elif kind == "kill_step":
        params = {"rank": rng.randrange(2), "step": rng.randrange(1, steps + 1)}
        params["delay"] = rng.uniform(0.0, 0.05)  # a step takes some tens of milliseconds
        world = 1 if rng.random() < ONE_PROCESS_SHARE else 2
    elif kind == "kill_save":
        params = {
            "rank": rng.randrange(2),
            "point": rng.choice(workload.SAVE_POINTS),
            "step": rng.choice(saves_at),
            "offset": rng.randrange(0, 16000),
        }
        if params["point"] == "marker":
            params["offset"] = rng.randrange(0, 400)  # the marker has some 340 bytes
        if params["point"] == "prune":  # the first save that prunes: keep=2, the third
            params["step"] = rng.choice(saves_at[2:])
        world = 1 if rng.random() < ONE_PROCESS_SHARE else 2
    elif kind == "kill_resume":
        params = {
            "rank": rng.randrange(2),
            "point": rng.choice(workload.RESUME_POINTS),
            "offset": rng.randrange(2),
            "newest": rng.choice(saves_at[1:-1]),
        }
    elif kind == "kill_worker":
        params = {"rank": rng.randrange(2), "step": rng.randrange(1, steps + 1)}
        params["delay"] = rng.uniform(0.0, 0.05)
    elif kind == "signal":
        params = {
            "rank": rng.randrange(2),
            "step": rng.randrange(1, steps),
            "delay": rng.uniform(0.0, 0.05),
            "again": rng.uniform(0.0, 0.02),
            "signum": int(rng.choice((signal.SIGUSR1, signal.SIGTERM))),
        }
    elif kind == "disk_full":
        params = {"pages": rng.randrange(4, 30)}  # a save takes some 11 pages
    elif kind == "read_only":
        params = {"newest": rng.choice(saves_at[1:-1])}
    elif kind == "launcher":
        params = {
            "target": rng.choice(("grandparent", "parent", "self", "signal")),
            "rank": rng.randrange(2),
            "step": rng.randrange(1, steps),
            "delay": rng.uniform(0.0, 0.05),
        }
    else:
        raise ValueError(f"no fault kind {kind!r}")
    return Fault(index, kind, world, params)


# --- processes ----------------------------------------------------------------------------------


def _prctl(option: int, value: int) -> int:
    if not sys.platform.startswith("linux"):
        return -1
    return int(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0))


@contextlib.contextmanager
def reaper() -> Iterator[bool]:
    """Make this process the reaper of its orphaned descendants while inside (Linux)."""
    done = _prctl(36, 1) == 0  # PR_SET_CHILD_SUBREAPER
    try:
        yield done
    finally:
        if done:
            _prctl(36, 0)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    # A PYTHONPATH given first: it may name another gpukit tree to test.
    env["PYTHONPATH"] = os.pathsep.join(
        [*filter(None, [env.get("PYTHONPATH")]), str(ROOT / "src"), str(ROOT)]
    )
    return env


class Zygote:
    """A process that imported torch once and forks one rank per request."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(WORKLOAD), "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_env(),
            cwd=ROOT,
        )
        assert self.process.stdout is not None
        self._out = self.process.stdout.fileno()
        self._pending = b""

    def fork(self, tag: str, plan: dict[str, Any], rank: int, world: int, store: str) -> None:
        """Ask for rank ``rank`` of a run; its pid comes back through :meth:`events`."""
        assert self.process.stdin is not None
        request = {"tag": tag, "plan": plan, "rank": rank, "world": world, "store": store}
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()

    def events(self, wait: float) -> list[dict[str, Any]]:
        """What the zygote said within ``wait`` seconds: forks and ends."""
        ready, _, _ = select.select([self._out], [], [], wait)
        if ready:
            chunk = os.read(self._out, 1 << 16)
            if not chunk:
                raise RuntimeError("the zygote ended")
            self._pending += chunk
        found = []
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            found.append(json.loads(line))
        return found

    def close(self) -> None:
        """Let the zygote end (it waits for its ranks); kill it if it does not."""
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _read_run(report: Path, world: int) -> tuple[dict[int, list[list[str]]], dict[int, bytes]]:
    events: dict[int, list[list[str]]] = {}
    weights: dict[int, bytes] = {}
    for rank in range(world):
        path = report / f"events-{rank}"
        lines = path.read_text().splitlines() if path.exists() else []
        events[rank] = [
            line.split(" ", 4) if line.startswith("error") else line.split() for line in lines
        ]
        result = report / f"result-{rank}.json"
        if result.exists():
            weights[rank] = bytes.fromhex(json.loads(result.read_text())["weights"])
    return events, weights


def run_forked(zygote: Zygote, plan: dict[str, Any], world: int, tag: str) -> RunResult:
    """Run ``world`` ranks forked by the zygote; act as their launcher: once a rank fails (an
    exit other than 0 and 75, or a signal) kill the others, as torchrun does; past
    :data:`RUN_BOUND_S` kill them all and call it a hang."""
    report = Path(plan["report"])
    report.mkdir(parents=True, exist_ok=True)
    store = str(report / "store")
    start = time.monotonic()
    for rank in range(world):
        zygote.fork(tag, plan, rank, world, store)
    pids: dict[int, int] = {}
    codes: dict[int, int | None] = {}
    order: list[int] = []
    hung = False
    ended_at: float | None = None
    while len(codes) < world:
        for said in zygote.events(0.01):
            if said["tag"] != tag:
                continue
            if "status" not in said:
                order.append(said["pid"])
                pids[said["pid"]] = len(order) - 1
            else:
                codes[pids[said["pid"]]] = said["status"]
        now = time.monotonic()
        failed = any(code not in (0, PREEMPTED) for code in codes.values())
        if codes and ended_at is None:
            ended_at = now
        late = ended_at is not None and now - ended_at > 30.0  # a peer that does not follow
        if failed or late or now - start > RUN_BOUND_S:
            if now - start > RUN_BOUND_S or (late and not failed):
                hung = True
            for pid, rank in pids.items():
                if rank not in codes:
                    _killpg(pid)
            if now - start > RUN_BOUND_S + 30:
                break  # the zygote never told: give up on it
    events, weights = _read_run(report, world)
    return RunResult(codes, hung, events, weights, time.monotonic() - start)


def run_launcher(
    plan: dict[str, Any], tag: str, settle: Callable[[], None] | None = None
) -> RunResult:
    """Run 2 ranks through ``gpukit run --ddp --cpu-ok -n 2`` (torchrun underneath).

    ``settle`` is called once the launcher has ended and before its report is read: a
    launcher killed with SIGKILL has told torchrun to stop, whose workers may still be saving.
    """
    report = Path(plan["report"])
    report.mkdir(parents=True, exist_ok=True)
    plan_file = report / "plan.json"
    plan_file.write_text(json.dumps(plan))
    gpukit = Path(sys.executable).with_name("gpukit")
    start = time.monotonic()
    with open(report / "launcher.log", "wb") as log:
        process = subprocess.Popen(
            [
                str(gpukit),
                "run",
                "--ddp",
                "--cpu-ok",
                "-n",
                "2",
                "--",
                sys.executable,
                str(WORKLOAD),
                str(plan_file),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(),
            cwd=ROOT,
            start_new_session=True,
        )
        hung = False
        try:
            code: int | None = process.wait(timeout=LAUNCHER_BOUND_S)
        except subprocess.TimeoutExpired:
            hung = True
            _killpg(process.pid)
            process.wait()
            code = None
    if settle is not None:
        settle()
    events, weights = _read_run(report, 2)
    return RunResult({-1: code}, hung, events, weights, time.monotonic() - start)


def descendants() -> list[int]:
    """The live processes under this one, but the zygote's own line (reaping zombies)."""
    import psutil

    me = psutil.Process()
    found = []
    for child in me.children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(child.pid, os.WNOHANG)
                continue
            found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


class Leftovers:
    """Processes alive after their run ended: given :data:`LINGER_S` to end, then counted."""

    def __init__(self, known: set[int]) -> None:
        self.known = known
        self.waiting: dict[int, tuple[float, Record]] = {}

    def after_run(self, record: Record) -> None:
        """Note the processes still alive now that ``record``'s run has ended."""
        now = time.monotonic()
        for pid in descendants():
            if pid not in self.known and pid not in self.waiting:
                self.waiting[pid] = (now + LINGER_S, record)

    def settle(self) -> None:
        """Wait, at most :data:`LINGER_S` seconds, for the processes a run left running to end
        (those still alive then are counted by :meth:`after_run`)."""
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline:
            if all(pid in self.known or pid in self.waiting for pid in descendants()):
                return
            time.sleep(0.05)

    def check(self, *, final: bool = False) -> None:
        """Count (and kill) those past their time; with ``final``, wait for all of them."""
        import psutil

        while self.waiting:
            now = time.monotonic()
            alive = set(descendants())
            for pid, (deadline, record) in list(self.waiting.items()):
                if pid not in alive:
                    del self.waiting[pid]
                elif now > deadline:
                    with contextlib.suppress(psutil.Error):
                        name = " ".join(psutil.Process(pid).cmdline())[:120]
                        record.notes.append(f"left behind: pid {pid} {name}")
                    record.left_behind += 1
                    _killpg(pid)
                    del self.waiting[pid]
            if not final:
                return
            time.sleep(0.2)


# --- the saves on disk --------------------------------------------------------------------------


def _saves(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.startswith("step-") and p.is_dir())


def _step(save: Path) -> int:
    return int(save.name.split("-")[1])


class Reference:
    """The run never interrupted: its saves (all kept) and final weights, and the 1-process
    resumes from each of its saves (made when first needed)."""

    def __init__(self, zygote: Zygote, work: Path) -> None:
        self.zygote = zygote
        self.work = work
        self.folder = work / "reference" / "run"
        # Saved at every step (any save a fault leaves has its twin here), and again as the
        # faults' runs save: saving changes nothing of the training.
        runs = [
            run_forked(zygote, _plan(work / "reference", keep=100, save_every=1), 2, "reference"),
            run_forked(zygote, _plan(work / "reference-again", keep=100), 2, "reference-again"),
        ]
        for run in runs:
            if run.hung or set(run.codes.values()) != {0} or len(run.weights) != 2:
                raise RuntimeError(f"the reference run failed: {run.codes} {run.said('error')}")
        self.weights = runs[0].weights[0]
        if any(w != self.weights for run in runs for w in run.weights.values()):
            raise RuntimeError("the uninterrupted run is not deterministic: nothing to compare")
        self.by_step = {_step(save): save for save in _saves(self.folder)}
        self._one: dict[int, bytes] = {}

    def save(self, step: int) -> Path:
        """The uninterrupted run's save of ``step``."""
        return self.by_step[step]

    def one_process(self, step: int | None) -> bytes | None:
        """The weights of 1 process resumed from the intact save of ``step`` (None: fresh)."""
        key = -1 if step is None else step
        if key not in self._one:
            base = self.work / f"reference-one-{key}"
            plan = _plan(base)
            if step is not None:
                Path(plan["folder"]).mkdir(parents=True)
                shutil.copytree(self.save(step), Path(plan["folder"]) / self.save(step).name)
            run = run_forked(self.zygote, plan, 1, f"reference-one-{key}")
            if 0 not in run.weights:
                raise RuntimeError(f"the 1-process reference from step {step} failed")
            self._one[key] = run.weights[0]
        return self._one[key]

    def intact(self, save: Path) -> bool:
        """Whether ``save`` has its marker and files that hold what the uninterrupted run's
        save of that step holds: the same bytes, or (a resumed run's ``torch.save`` may lay
        out the same state otherwise) the same objects, tensors compared by ``torch.equal``."""
        step = _step(save)
        if step not in self.by_step or not (save / "COMPLETE.json").is_file():
            return False
        reference = self.by_step[step]
        for name in ("shared.pt", "rank-00000.pt", "rank-00001.pt"):
            try:
                if (save / name).read_bytes() != (reference / name).read_bytes() and not _same(
                    _load(save / name), _load(reference / name)
                ):
                    return False
            except Exception:  # a file that does not load is not intact, whatever the reason
                return False
        return True


def _load(path: Path) -> Any:
    import torch

    return torch.load(path, weights_only=False)  # the benchmark's own files


def _same(a: Any, b: Any) -> bool:
    """Whether two loaded states are equal: tensors by ``torch.equal``, arrays by value."""
    import numpy as np
    import torch

    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _plan(base: Path, **more: Any) -> dict[str, Any]:
    return {"folder": str(base / "run"), "report": str(base / "report"), "keep": 2, **more}


def _copy_saves(reference: Reference, folder: Path, steps: Sequence[int]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for step in steps:
        source = reference.save(step)
        shutil.copytree(source, folder / source.name)


def _damage(path: Path, kind: str, at: float, mask: int) -> str:
    size = path.stat().st_size
    if kind == "remove":
        path.unlink()
        return f"removed {path.name}"
    if kind == "truncate":
        length = int(at * size)
        os.truncate(path, length)
        return f"cut {path.name} from {size} to {length} bytes"
    offset = min(int(at * size), size - 1)
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ mask]))
    return f"flipped byte {offset} of {path.name} ({byte:#04x} ^ {mask:#04x})"


# --- one fault ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _tmpfs(folder: Path, pages: int) -> Iterator[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={pages * PAGE}", "tmpfs", str(folder)], check=True
    )
    try:
        yield folder
    finally:
        for _ in range(50):
            if subprocess.run(["umount", str(folder)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)


def _remount(folder: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(folder)], check=True)


def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root, and a kernel that lets it)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    with tempfile.TemporaryDirectory() as folder:
        try:
            with _tmpfs(Path(folder), 4):
                return True
        except (subprocess.CalledProcessError, OSError):
            return False


class Matrix:
    """The faults' runs: the zygote, the reference, the leftovers, one record per fault."""

    def __init__(self, work: Path) -> None:
        self.work = work
        # What this process ran before the matrix (a test session's clusters, say) is not
        # the faults' to count, nor to kill.
        before = set(descendants())
        self.zygote = Zygote()
        self.reference = Reference(self.zygote, work)
        self.leftovers = Leftovers({*before, self.zygote.process.pid})
        self.mount = can_mount()

    def close(self) -> None:
        """Wait out the leftovers, then let the zygote go."""
        self.leftovers.check(final=True)
        self.zygote.close()

    # Each fault kind: prepare a folder, inject, then :meth:`_finish` resumes and judges.

    def run(self, fault: Fault) -> Record:
        """Inject ``fault``, resume the run to its end, and judge what happened."""
        record = Record(fault.index, fault.kind, fault.params, fault.resume_world)
        start = time.monotonic()
        base = self.work / f"fault-{fault.index:05d}"
        self.leftovers.check()
        try:
            getattr(self, f"_{fault.kind}")(fault, record, base)
        finally:
            self.leftovers.after_run(record)
            record.seconds = time.monotonic() - start
            shutil.rmtree(base, ignore_errors=True)
        return record

    def _forked(self, plan: dict[str, Any], record: Record, world: int = 2) -> RunResult:
        run = run_forked(self.zygote, plan, world, f"{record.index}-{plan['report']}")
        self.leftovers.after_run(record)
        return run

    def _fault_run(self, record: Record, run: RunResult) -> None:
        record.fault_exit = {str(rank): code for rank, code in run.codes.items()}
        record.fault_errors = [" ".join(line) for line in run.said("error")]
        if run.hung:
            record.outcome = "hang"
            record.notes.append(f"the faulted run hung: {run.codes}")

    def _damage_kind(self, fault: Fault, record: Record, base: Path) -> None:
        p = fault.params
        folder = base / "run"
        newest = p["newest"]
        _copy_saves(self.reference, folder, (newest - workload.SAVE_EVERY, newest))
        target = next(s for s in _saves(folder) if _step(s) == p["save"]) / p["file"]
        record.notes.append(_damage(target, fault.kind, p["at"], p["mask"]))
        # The other save is whole: the resume may take it, or a newer one whose marker alone
        # was damaged (its files are whole), never an older one.
        expected = max(_step(s) for s in _saves(folder) if _step(s) != p["save"])
        self._finish(
            record,
            base,
            expected=expected,
            last_complete=None,
            # A marker changed in a way that still parses leaves whole files: loading them is
            # no damaged load (an older save taken instead of a newer one is caught as lost).
            damaged=set() if p["file"] == "COMPLETE.json" else {target.parent.name},
        )

    _flip = _damage_kind
    _truncate = _damage_kind
    _remove = _damage_kind

    def _kill_plan(self, fault: Fault, how: str, target: str = "self") -> dict[str, Any]:
        return {"how": how, "target": target, **fault.params}

    def _killed_run(self, fault: Fault, record: Record, base: Path, kill: dict[str, Any]) -> None:
        run = self._forked(_plan(base, kill=kill), record)
        self._fault_run(record, run)
        if record.outcome == "hang":
            return
        self._finish(record, base, expected=None, last_complete=_last_complete(run))

    def _kill_step(self, fault: Fault, record: Record, base: Path) -> None:
        self._killed_run(fault, record, base, self._kill_plan(fault, "timer"))

    def _kill_worker(self, fault: Fault, record: Record, base: Path) -> None:
        self._killed_run(fault, record, base, self._kill_plan(fault, "timer", "worker"))

    def _kill_save(self, fault: Fault, record: Record, base: Path) -> None:
        self._killed_run(fault, record, base, self._kill_plan(fault, "point"))

    def _kill_resume(self, fault: Fault, record: Record, base: Path) -> None:
        p = fault.params
        newest = p["newest"]
        _copy_saves(self.reference, base / "run", (newest - workload.SAVE_EVERY, newest))
        kill = {"how": "point", "rank": p["rank"], "point": p["point"], "offset": p["offset"]}
        run = self._forked(_plan(base, kill=kill), record)
        self._fault_run(record, run)
        if record.outcome != "hang":
            self._finish(record, base, expected=newest, last_complete=newest)

    def _signal(self, fault: Fault, record: Record, base: Path) -> None:
        run = self._forked(_plan(base, signal=fault.params), record)
        self._fault_run(record, run)
        if record.outcome == "hang":
            return
        stopped = {int(line[0]) for line in run.said("preempted")}
        codes = set(run.codes.values())
        if len(stopped) > 1:
            record.notes.append(f"the ranks stopped at different steps: {sorted(stopped)}")
        if codes != {PREEMPTED} and stopped:
            record.notes.append(f"preempted, but the ranks exited {run.codes}")
        if codes == {0}:
            record.notes.append("the signal came after the last check: the run ended")
        self._finish(
            record,
            base,
            expected=min(stopped) if stopped else None,
            last_complete=_last_complete(run),
        )

    def _disk_full(self, fault: Fault, record: Record, base: Path) -> None:
        folder = base / "run"
        with _tmpfs(folder, fault.params["pages"]):
            run = self._forked(_plan(base), record)
            self._fault_run(record, run)
            errors = run.said("error")
            if any(line[0] != "typed" for line in errors):
                record.notes.append(f"a full disk gave an untyped error: {errors}")
            if record.outcome == "hang":
                return
            _remount(folder, f"size={64 << 20}")  # space freed: the run goes on
            self._finish(record, base, expected=None, last_complete=_last_complete(run))

    def _read_only(self, fault: Fault, record: Record, base: Path) -> None:
        folder = base / "run"
        newest = fault.params["newest"]
        with _tmpfs(folder, 4096):
            _copy_saves(self.reference, folder, (newest - workload.SAVE_EVERY, newest))
            _remount(folder, "ro")
            run = self._forked(_plan(base), record)
            self._fault_run(record, run)
            errors = run.said("error")
            if not errors or any(line[0] != "typed" for line in errors):
                record.notes.append(f"a read-only folder gave: {errors or 'no error'}")
            if record.outcome == "hang":
                return
            _remount(folder, "rw")
            self._finish(record, base, expected=newest, last_complete=newest)

    def _launcher(self, fault: Fault, record: Record, base: Path) -> None:
        p = fault.params
        if p["target"] == "signal":
            extra: dict[str, Any] = {"signal": {**p, "again": 0.01, "signum": int(signal.SIGTERM)}}
        else:
            extra = {"kill": {**p, "how": "timer"}}
        run = run_launcher(_plan(base, **extra), f"{record.index}", self.leftovers.settle)
        self.leftovers.after_run(record)
        self._fault_run(record, run)
        if record.outcome == "hang":
            return
        stopped = [int(line[0]) for line in run.said("preempted")]
        self._finish(
            record,
            base,
            expected=min(stopped) if stopped else None,
            last_complete=_last_complete(run),
        )

    # The resume to the end, and the verdict.

    def _finish(
        self,
        record: Record,
        base: Path,
        *,
        expected: int | None,
        last_complete: int | None,
        damaged: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """Resume the run in ``base`` to its end and judge it. ``expected``: the step of the
        newest save it must resume (None: the newest intact one found); ``last_complete``: the
        newest save reported complete before the fault; ``damaged``: saves damaged on purpose
        (never intact, even when what they hold still loads as the original)."""
        folder = base / "run"
        found = _saves(folder)
        intact = {s.name for s in found if s.name not in damaged and self.reference.intact(s)}
        newest_intact = max((_step(s) for s in found if s.name in intact), default=None)
        if expected is None:
            expected = newest_intact
        record.expected_step = expected
        if last_complete is not None and (newest_intact is None or newest_intact < last_complete):
            record.lost = True
            record.notes.append(
                f"save of step {last_complete} reported complete, newest intact after the fault: "
                f"{newest_intact}"
            )
        world = record.resume_world
        run = self._forked({**_plan(base / "resume"), "folder": str(folder)}, record, world)
        resumed = run.said("resumed")
        if resumed:
            name = resumed[0][0]
            record.resumed = None if name == "-" else name
            record.resumed_step = None if name == "-" else int(name.split("-")[1])
            record.passed_over = int(resumed[0][2])
        if record.resumed is not None and record.resumed not in intact:
            record.damaged_load = True
            record.notes.append(f"resumed {record.resumed}, which is torn or damaged")
        if expected is not None and (record.resumed_step or 0) < expected:
            record.lost = True
            record.notes.append(f"resumed step {record.resumed_step}, newest intact {expected}")
        errors = run.said("error")
        if run.hung:
            record.outcome = "hang"
        elif errors:
            record.outcome = "typed_error" if errors[0][0] == "typed" else "untyped_error"
            record.notes.append("resume failed: " + " ".join(errors[0]))
        elif len(run.weights) != world:
            record.outcome = "untyped_error"
            record.notes.append(f"resume ended without weights: {run.codes}")
        else:
            if world == 2:
                reference = self.reference.weights
            else:
                reference = (
                    self.reference.one_process(
                        record.resumed_step if record.resumed in intact else None
                    )
                    or b""
                )
            equal = all(_equal(w, reference) for w in run.weights.values())
            record.outcome = "equal" if equal else "diverged"


def _equal(a: bytes, b: bytes) -> bool:
    """``torch.equal`` of two float64 weight vectors given as bytes."""
    import torch

    if len(a) != len(b):
        return False
    return bool(
        torch.equal(
            torch.frombuffer(bytearray(a), dtype=torch.float64),
            torch.frombuffer(bytearray(b), dtype=torch.float64),
        )
    )


def _last_complete(run: RunResult) -> int | None:
    steps = [int(line[0]) for line in run.said("complete")]
    return max(steps) if steps else None


# --- the matrix ---------------------------------------------------------------------------------


def _asks_to_stop(record: Record) -> bool:
    """Whether the fault asks the run to stop (a signal to a rank; ``gpukit run`` signalled,
    or killed, which tells torchrun to stop): the run must then stop at a step's end, never
    fail mid-step. A rank killed is no request: the others' errors follow from it."""
    target = record.params.get("target")
    return record.kind == "signal" or (
        record.kind == "launcher" and target in ("signal", "grandparent")
    )


def _unclean_stop(record: Record) -> bool:
    """Whether a run asked to stop failed instead, with an untyped error (a DataLoader worker
    killed by the signal, say)."""
    return _asks_to_stop(record) and any(e.startswith("untyped") for e in record.fault_errors)


def summarize(records: Sequence[Record], seconds: float) -> dict[str, Any]:
    """The figures of a matrix: counts over all faults, and per kind."""
    same = [r for r in records if r.resume_world == 2]
    outcomes = Counter(r.outcome for r in records)
    return {
        "faults": len(records),
        "seconds": round(seconds, 1),
        "equal": outcomes["equal"],
        "same_world_resumed": len(same),
        "same_world_equal": sum(r.outcome == "equal" for r in same),
        "silent_divergences": outcomes["diverged"],
        "typed_errors": outcomes["typed_error"],
        "untyped_errors": outcomes["untyped_error"],
        "hangs": outcomes["hang"],
        "damaged_loads": sum(r.damaged_load for r in records),
        "lost_saves": sum(r.lost for r in records),
        "left_behind": sum(r.left_behind for r in records),
        "passed_over": sum(r.passed_over > 0 for r in records),
        "unclean_stops": sum(_unclean_stop(r) for r in records),
        "by_kind": {
            kind: dict(Counter(r.outcome for r in records if r.kind == kind))
            for kind in sorted({r.kind for r in records})
        },
    }


def run_matrix(
    faults: Sequence[Fault], work: Path, *, progress: bool = False
) -> tuple[list[Record], dict[str, Any]]:
    """Inject every fault in ``faults`` (under ``work``); return the records and the figures."""
    start = time.monotonic()
    records: list[Record] = []
    with reaper():
        matrix = Matrix(work)
        try:
            for fault in faults:
                record = matrix.run(fault)
                records.append(record)
                if progress:
                    _progress(record, len(records), len(faults), time.monotonic() - start)
        finally:
            matrix.close()
    return records, summarize(records, time.monotonic() - start)


def _progress(record: Record, done: int, total: int, seconds: float) -> None:
    flags = "".join(
        mark
        for mark, on in (
            (" DAMAGED", record.damaged_load),
            (" LOST", record.lost),
            (" LEFT", record.left_behind > 0),
        )
        if on
    )
    line = (
        f"[{done:>4}/{total}] {seconds:7.1f}s {record.kind:<11} {record.outcome:<13} "
        f"resumed {record.resumed_step} (newest intact {record.expected_step}) "
        f"on {record.resume_world}{flags}"
    )
    print(line, flush=True)
    for note in record.notes:
        if not note.startswith(("flipped", "cut", "removed")) or record.outcome != "equal":
            print(f"         {note}", flush=True)


def table(summary: dict[str, Any]) -> str:
    """The figures as a plain-text table."""
    rows = [
        ("faults injected", summary["faults"]),
        ("resumed on 2 processes", summary["same_world_resumed"]),
        ("  ended bitwise equal", summary["same_world_equal"]),
        ("all runs ended bitwise equal", summary["equal"]),
        ("silent divergences", summary["silent_divergences"]),
        ("failed with a typed gpukit error", summary["typed_errors"]),
        ("failed with an untyped error", summary["untyped_errors"]),
        ("hangs", summary["hangs"]),
        ("loads of a torn or damaged save", summary["damaged_loads"]),
        ("saves lost beyond the last complete one", summary["lost_saves"]),
        ("processes left behind", summary["left_behind"]),
        ("resumes that passed over a save", summary["passed_over"]),
        ("stops that failed with an untyped error", summary["unclean_stops"]),
        ("seconds", summary["seconds"]),
    ]
    lines = [f"{name:<42} {value:>8}" for name, value in rows]
    lines.append("")
    lines.append(f"{'kind':<12} outcomes")
    for kind, counts in summary["by_kind"].items():
        lines.append(f"{kind:<12} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: inject, print the table, write the JSON; 1 if an invariant broke."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=30, help="how many faults (30)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the draw (0)")
    parser.add_argument("--out", type=Path, help="write the records and figures as JSON here")
    parser.add_argument("--work", type=Path, help="the folder for the runs (a temporary one)")
    args = parser.parse_args(argv)
    mount = can_mount()
    if not mount:
        print("not root (or no mount): full-disk and read-only faults left out", flush=True)
    faults = plan_faults(args.faults, args.seed, can_mount=mount)
    print(
        f"{len(faults)} faults: "
        + ", ".join(f"{k} {v}" for k, v in sorted(Counter(f.kind for f in faults).items())),
        flush=True,
    )
    with contextlib.ExitStack() as stack:
        if args.work is not None:  # a new folder in it: never a run's leftovers as events
            args.work.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix="faults-", dir=args.work))
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        records, summary = run_matrix(faults, work, progress=True)
    print(table(summary))
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "summary": summary,
                    "mix": MIX,
                    "seed": args.seed,
                    "records": [asdict(r) for r in records],
                },
                indent=1,
            )
        )
    broken = (
        summary["silent_divergences"]
        or summary["hangs"]
        or summary["damaged_loads"]
        or summary["lost_saves"]
        or summary["left_behind"]
        or summary["unclean_stops"]
        or summary["same_world_equal"] != summary["same_world_resumed"]
    )
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
