"""``gpukit run --ddp``: a signal gpukit forwards reaches every torchrun worker, and the GPUs stay
claimed until the last worker has ended.

Slurm's usual "save now" (``--signal=USR1@90``, ``scancel --signal=USR1``) reaches gpukit, which
forwards it to torchrun. torchrun passes on only the signals it is told to handle; torch's
default list leaves SIGUSR1 out, so torchrun died of it, its workers (each in a session of its
own) never heard of it and ran on without a parent, and gpukit released the claims of GPUs they
still used.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpukit.sharing.claims import current_claims
from tests.helpers import MACHINES, ROOT

L4 = MACHINES / "server-4xL4-idle.json"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(signal, "sigtimedwait"), reason="signals are passed on this way only on Linux"
    ),
]

# A gloo worker that notes its pid and its parent's (torchrun), then lingers (as a worker saving
# its state does) until the test lets it go, writing down every SIGUSR1 and SIGTERM it gets as
# they come. argv: a folder.
_WORKER = """
import os, pathlib, signal, sys, time
import torch.distributed as dist
folder = pathlib.Path(sys.argv[1])
got = []
signal.signal(signal.SIGUSR1, lambda n, f: got.append(n))
signal.signal(signal.SIGTERM, lambda n, f: got.append(n))
dist.init_process_group("gloo")
rank = dist.get_rank()
(folder / f"ready-{rank}").write_text(f"{os.getpid()} {os.getppid()}")
seen = 0
while not (folder / "go").exists():
    if len(got) != seen:
        seen = len(got)
        (folder / "tmp").mkdir(exist_ok=True)
        (folder / "tmp" / str(rank)).write_text(" ".join(signal.Signals(n).name for n in got))
        os.replace(folder / "tmp" / str(rank), folder / f"seen-{rank}")
    time.sleep(0.01)
dist.destroy_process_group()
"""


def _until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie that no parent reaped has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _parent(pid: int) -> int | None:
    """The parent of ``pid`` while it runs, else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return None if fields[0] == "Z" else int(fields[1])


def _seen(folder: Path, rank: int) -> list[str]:
    """The signals worker ``rank`` got so far, in order."""
    path = folder / f"seen-{rank}"
    return path.read_text().split() if path.exists() else []


def _signalled_ddp_run(tmp_path: Path, *, also_to_torchrun: bool) -> int:
    """Run 2 gloo workers under ``gpukit run --ddp``, send gpukit SIGUSR1 (and torchrun its own
    copy first, as Slurm does, when ``also_to_torchrun``), check that each worker got every copy
    as SIGUSR1 and that the claims last while they run; let them end; return gpukit's exit
    status."""
    locks = tmp_path / "locks"
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(locks)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "gpukit", "run", "-n", "2", "--ddp", "--"]
    gpukit = subprocess.Popen(
        [*argv, "python", str(script), str(tmp_path)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
    workers: list[int] = []
    try:
        _until(lambda: all(p.exists() and p.read_text() for p in ready))
        workers = [int(p.read_text().split()[0]) for p in ready]
        torchrun = int(ready[0].read_text().split()[1])
        copies = 1
        if also_to_torchrun:  # Slurm signals every process of the step; gpukit's copy follows
            os.kill(torchrun, signal.SIGUSR1)
            _until(lambda: len(_seen(tmp_path, 0)) == len(_seen(tmp_path, 1)) == 1)
            copies = 2
        gpukit.send_signal(signal.SIGUSR1)  # as srun or scancel --signal=USR1 does
        _until(lambda: len(_seen(tmp_path, 0)) == len(_seen(tmp_path, 1)) == copies)
        assert [_seen(tmp_path, r) for r in (0, 1)] == [["SIGUSR1"] * copies] * 2
        # The workers still run: gpukit, and its claims, must still be there.
        assert all(_alive(pid) for pid in workers)
        assert _alive(torchrun)
        assert gpukit.poll() is None
        assert len(current_claims(locks)) == 2
        (tmp_path / "go").touch()
        code = gpukit.wait(timeout=60)
        # The claims ended with gpukit: by then every worker must have ended too.
        assert not [pid for pid in workers if _alive(pid)]
        assert current_claims(locks) == {}
        return code
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(gpukit.pid, signal.SIGKILL)
        gpukit.wait(timeout=30)


def test_sigusr1_to_gpukit_reaches_every_ddp_worker_and_the_claim_outlives_them(
    tmp_path: Path,
) -> None:
    code = _signalled_ddp_run(tmp_path, also_to_torchrun=False)
    assert code == 128 + signal.SIGUSR1  # torchrun ended by SIGUSR1, as gpukit run reports it


def test_a_second_copy_of_the_signal_to_torchrun_does_not_cut_the_workers_save_short(
    tmp_path: Path,
) -> None:
    # torchrun's agent answered a second signal during its wait with SIGTERM to the workers
    # (and a third by leaving them running): each copy must reach them as what it is.
    _signalled_ddp_run(tmp_path, also_to_torchrun=True)


def test_workers_of_a_killed_torchrun_keep_the_claim_until_they_end(tmp_path: Path) -> None:
    # torchrun killed outright (the OOM killer, kill -9) leaves its workers running: they become
    # gpukit's children, and the GPUs they use stay claimed.
    locks = tmp_path / "locks"
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(locks)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "gpukit", "run", "-n", "2", "--ddp", "--"]
    gpukit = subprocess.Popen(
        [*argv, "python", str(script), str(tmp_path)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
    workers: list[int] = []
    try:
        _until(lambda: all(p.exists() and p.read_text() for p in ready))
        workers = [int(p.read_text().split()[0]) for p in ready]
        os.kill(int(ready[0].read_text().split()[1]), signal.SIGKILL)
        _until(lambda: all(_parent(pid) == gpukit.pid for pid in workers))
        assert gpukit.poll() is None
        assert len(current_claims(locks)) == 2
        (tmp_path / "go").touch()
        assert gpukit.wait(timeout=60) == 128 + signal.SIGKILL  # torchrun's end
        assert not [pid for pid in workers if _alive(pid)]
        assert current_claims(locks) == {}
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(gpukit.pid, signal.SIGKILL)
        gpukit.wait(timeout=30)
