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

from gpukit.distributed.torchrun_agent import how_workers_ended, workers_exit_code
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


def test_the_line_of_how_workers_ended_tells_the_first_failure_from_torchruns_stopping() -> None:
    failures = {0: _Failure(-signal.SIGTERM, 11), 1: _Failure(3, 11), 2: _Failure(-9, 10)}
    assert how_workers_ended(failures) == (
        "rank 0 was stopped (SIGTERM), rank 1 exited 3, rank 2 was killed by SIGKILL"
    )
    assert how_workers_ended({0: _Failure(-signal.SIGTERM, 4)}) == "rank 0 was killed by SIGTERM"


# Every rank raises a gpukit refusal, or (argv: "other") an exception of another kind.
_REFUSING = """
import sys
import gpukit as gk
from gpukit.errors import InvalidArgumentError
gk.distributed.init()
if sys.argv[1:] == ["other"]:
    raise ValueError("not gpukit's")
raise InvalidArgumentError("a global batch of 32 cannot be split over 3 processes.",
                           hint="Use a global batch divisible by 3.")
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["refusal", "other", "traceback asked for"])
def test_a_refusal_on_every_rank_is_one_line_each_and_anything_else_keeps_its_traceback(
    run_cli: CliRunner, tmp_path: Path, kind: str
) -> None:
    script = tmp_path / "refuse.py"
    script.write_text(_REFUSING)
    env: dict[str, str | None] = {
        "GPUKIT_FAKE_NVML": str(MACHINES / "no-driver.json"),
        "MASTER_ADDR": None,
        "MASTER_PORT": None,
        "GPUKIT_TRACEBACK": "1" if kind == "traceback asked for" else None,
    }
    argv = [sys.executable, str(script), *(["other"] if kind == "other" else [])]
    done = run_cli("run", "--ddp", "--cpu-ok", "-n", "2", "--", *argv, env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    refusals = [line for line in done.stderr.splitlines() if "cannot be split" in line]
    if kind == "refusal":
        assert "Traceback" not in done.stderr
        assert sorted(refusals) == [
            f"[rank{rank}]: gpukit: InvalidArgumentError: a global batch of 32 cannot be split "
            "over 3 processes. Use a global batch divisible by 3."
            for rank in (0, 1)
        ]
    else:
        assert "Traceback" in done.stderr
    assert "Root Cause" not in done.stderr
    assert "exited 1" in done.stderr


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
    assert "rank 0 exited 3" in err or "rank 1 exited 3" in err
    assert "Root Cause" not in err  # torchrun's report of each failure: said in one line


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
