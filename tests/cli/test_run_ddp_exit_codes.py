"""``gpukit run --ddp`` ends with an exit code that says how the workers ended: 75 when they
stopped for preemption (so that a batch script can requeue the job), else the code of the
first worker that failed, as ``gpukit run`` without ``--ddp`` returns its command's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpukit.distributed.torchrun_agent import workers_exit_code
from gpukit.train.preempt import PREEMPTED_EXIT_CODE
from tests.helpers import MACHINES, CliRunner, subprocess_env

# Rank r waits DELAY[r] seconds, then exits with CODE[r]; argv: the codes, then the delays.
_WORKER = """
import os, sys, time
rank = int(os.environ["RANK"])
codes, delays = sys.argv[1].split(","), sys.argv[2].split(",")
time.sleep(float(delays[rank]))
sys.exit(int(codes[rank]))
"""

# A worker that stops for preemption when told to (SIGUSR1, as Slurm's --signal=USR1@90 asks),
# as gk.train.Preemption does: with exit code 75. argv: a folder for its ready-RANK file.
_PREEMPTIBLE = """
import os, pathlib, signal, sys, time
signal.signal(signal.SIGUSR1, lambda signum, frame: sys.exit(75))
pathlib.Path(sys.argv[1], "ready-" + os.environ["RANK"]).write_text("")
while True:
    time.sleep(0.05)
"""


@dataclass
class _Failure:
    """What torchrun's ``ProcessFailure`` says of a worker that failed."""

    exitcode: int
    timestamp: int


def test_workers_that_all_stopped_for_preemption_exit_75() -> None:
    failures = {0: _Failure(PREEMPTED_EXIT_CODE, 10), 1: _Failure(PREEMPTED_EXIT_CODE, 10)}
    assert workers_exit_code(failures) == PREEMPTED_EXIT_CODE == 75


def test_workers_that_agree_on_a_code_exit_with_it() -> None:
    assert workers_exit_code({1: _Failure(3, 10), 0: _Failure(3, 11)}) == 3


def test_a_failure_beside_a_preemption_is_not_reported_as_a_preemption() -> None:
    # Requeuing a job that failed would run it into the same failure again.
    assert workers_exit_code({0: _Failure(75, 10), 1: _Failure(3, 11)}) == 3


def test_workers_that_disagree_exit_with_the_first_failures_code() -> None:
    failures = {0: _Failure(4, 12), 1: _Failure(3, 11), 2: _Failure(75, 10)}
    assert workers_exit_code(failures) == 3


def test_workers_that_failed_at_the_same_second_keep_the_order_torchrun_saw() -> None:
    assert workers_exit_code({1: _Failure(4, 10), 0: _Failure(3, 10)}) == 4


def test_a_worker_ended_by_a_signal_counts_as_128_plus_n() -> None:
    assert workers_exit_code({0: _Failure(-9, 10)}) == 137


@pytest.mark.parametrize("stopped", [-15, -9])
def test_workers_torchrun_stops_after_a_preemption_leave_it_a_preemption(stopped: int) -> None:
    assert workers_exit_code({0: _Failure(75, 10), 1: _Failure(stopped, 10)}) == 75


def test_workers_torchrun_stops_after_a_failure_leave_its_code() -> None:
    # As torchrun lists them: the failure first, then the worker it stopped, at the same second.
    assert workers_exit_code({1: _Failure(3, 10), 0: _Failure(-15, 10)}) == 3


def test_a_worker_killed_before_any_other_failed_gives_the_signals_code() -> None:
    assert workers_exit_code({0: _Failure(-9, 10), 1: _Failure(75, 11)}) == 137


def _ddp_run(run_cli: CliRunner, tmp_path: Path, codes: str, delays: str) -> tuple[int, str]:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env: dict[str, str | None] = {
        "GPUKIT_FAKE_NVML": str(MACHINES / "no-driver.json"),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": None,
        "MASTER_PORT": None,
    }
    args = ("--torchrun-arg=--monitor-interval=0.05", "--", sys.executable, str(script))
    done = run_cli("run", "--ddp", "--cpu-ok", "-n", "2", *args, codes, delays, env=env)
    return done.returncode, done.stderr


@pytest.mark.slow
def test_workers_that_stopped_for_preemption_make_the_run_exit_75(
    run_cli: CliRunner, tmp_path: Path
) -> None:
    code, err = _ddp_run(run_cli, tmp_path, "75,75", "0,0")
    assert code == 75, err[-3000:]
    assert "Traceback" not in err
    assert "stopped for preemption" in err


@pytest.mark.slow
def test_workers_own_exit_code_is_the_runs(run_cli: CliRunner, tmp_path: Path) -> None:
    code, err = _ddp_run(run_cli, tmp_path, "3,3", "0,0")
    assert code == 3, err[-3000:]
    assert "Traceback" not in err
    assert "exitcode  : 3" in err  # torchrun's own report of the failure stays


@pytest.mark.slow
def test_a_failing_worker_beside_a_preempted_one_gives_its_own_code(
    run_cli: CliRunner, tmp_path: Path
) -> None:
    code, err = _ddp_run(run_cli, tmp_path, "75,3", "2,0")  # rank 1 fails first
    assert code == 3, err[-3000:]
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "sigtimedwait"), reason="signals pass on this way on Linux")
def test_workers_that_a_signal_to_gpukit_stopped_for_preemption_make_the_run_exit_75(
    tmp_path: Path,
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_PREEMPTIBLE)
    env = subprocess_env(
        GPUKIT_FAKE_NVML=str(MACHINES / "no-driver.json"),
        OMP_NUM_THREADS="1",
        MASTER_ADDR=None,
        MASTER_PORT=None,
    )
    argv = [sys.executable, "-m", "gpukit", "run", "--ddp", "--cpu-ok", "-n", "2", "--"]
    gpukit = subprocess.Popen(
        [*argv, "python", str(script), str(tmp_path)],
        env=env,
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready-{rank}").exists() for rank in (0, 1)):
            assert gpukit.poll() is None, gpukit.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.02)
        gpukit.send_signal(signal.SIGUSR1)  # as scancel --signal=USR1 does
        _, err = gpukit.communicate(timeout=60)
        assert gpukit.returncode == 75, err[-3000:]
        assert "Traceback" not in err
    finally:
        if gpukit.poll() is None:
            os.killpg(gpukit.pid, signal.SIGKILL)
            gpukit.wait(timeout=30)
