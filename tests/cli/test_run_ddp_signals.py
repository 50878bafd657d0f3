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

from gpukit.gpus.claims import current_claims
from tests.conftest import ROOT

L4 = ROOT / "tests" / "fixtures" / "machines" / "server-4xL4-idle.json"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(signal, "sigtimedwait"), reason="signals are passed on this way only on Linux"
    ),
]

# A gloo worker that notes its pid, notes SIGUSR1 when it comes, then lingers (as a worker
# saving its state does) until the test lets it go. argv: a folder.
_WORKER = """
import os, pathlib, signal, sys, time
import torch.distributed as dist
folder = pathlib.Path(sys.argv[1])
got = []
signal.signal(signal.SIGUSR1, lambda n, f: got.append(n))
dist.init_process_group("gloo")
rank = dist.get_rank()
(folder / f"ready-{rank}").write_text(str(os.getpid()))
while not got:
    time.sleep(0.01)
(folder / f"got-{rank}").write_text(signal.Signals(got[0]).name)
while not (folder / "go").exists():
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


def test_sigusr1_to_gpukit_reaches_every_ddp_worker_and_the_claim_outlives_them(
    tmp_path: Path,
) -> None:
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
        stderr=subprocess.PIPE,
    )
    ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
    workers: list[int] = []
    try:
        _until(lambda: all(p.exists() and p.read_text() for p in ready))
        workers = [int(p.read_text()) for p in ready]
        gpukit.send_signal(signal.SIGUSR1)  # as srun or scancel --signal=USR1 does
        _until(lambda: all((tmp_path / f"got-{r}").exists() for r in (0, 1)))
        assert [(tmp_path / f"got-{r}").read_text() for r in (0, 1)] == ["SIGUSR1"] * 2
        # The workers still run: gpukit, and its claims, must still be there.
        assert all(_alive(pid) for pid in workers)
        assert gpukit.poll() is None
        assert len(current_claims(locks)) == 2
        (tmp_path / "go").touch()
        gpukit.wait(timeout=60)
        # The claims ended with gpukit: by then every worker must have ended too.
        assert not [pid for pid in workers if _alive(pid)]
        assert current_claims(locks) == {}
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(gpukit.pid, signal.SIGKILL)
        gpukit.wait(timeout=30)
        assert gpukit.stderr is not None
        gpukit.stderr.close()
