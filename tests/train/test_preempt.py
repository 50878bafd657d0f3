"""Preemption in one process: the handler only notes, the loop saves, Slurm is asked to requeue.

(Two ranks agreeing on one step: ``test_preempt_across_ranks.py``.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

import pytest
import torch
from torch import nn

from gpukit.errors import InvalidArgumentError
from gpukit.train import TrainingState, TrainStep
from gpukit.train.preempt import PREEMPTED_EXIT_CODE, Preempted, Preemption
from tests.helpers import ROOT

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import preempt_accumulate as work


def _fake_scontrol(folder: Path, code: int = 0) -> Path:
    """An ``scontrol`` that writes its arguments to ``folder/scontrol.args``."""
    folder.mkdir(exist_ok=True)
    program = folder / "scontrol"
    program.write_text(f'#!/bin/sh\necho "$@" > {folder}/scontrol.args\nexit {code}\n')
    program.chmod(0o755)
    return folder


def test_a_signal_is_only_noted_until_the_loop_checks_and_then_the_loop_saves() -> None:
    saved: list[str] = []
    with Preemption(env={}) as preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert saved == []  # nothing is saved inside the handler
        assert preemption.received is signal.SIGUSR1
        assert preemption.should_stop()
        with pytest.raises(Preempted) as stopped:
            preemption.stop(lambda: saved.append("saved"))
    assert saved == ["saved"]
    assert stopped.value.code == PREEMPTED_EXIT_CODE == 75
    assert stopped.value.checks == 1


def test_no_signal_means_no_stop_check_after_check() -> None:
    with Preemption(env={}) as preemption:
        assert not any(preemption.should_stop() for _ in range(100))
        assert preemption.checks == 100


def test_a_signal_that_came_between_checks_is_not_lost() -> None:
    with Preemption(env={}) as preemption:
        assert not preemption.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(10_000))  # the step goes on; the signal waits for the next check
        assert preemption.should_stop()
        assert preemption.should_stop()  # and stays: a stop is never taken back


class _State:
    def __init__(self) -> None:
        self.saves = 0

    def save(self) -> None:
        self.saves += 1


def test_stop_saves_an_object_with_a_save_method() -> None:
    state = _State()
    with Preemption(env={}) as preemption, pytest.raises(Preempted):
        preemption.stop(state)
    assert state.saves == 1


def test_stop_waits_for_a_real_training_states_asynchronous_save_to_be_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from torch import nn

    from gpukit.train import state as state_module
    from gpukit.train.saves import newest

    run = state_module.SaveJob.run

    def slow_write(job: object) -> object:
        time.sleep(0.5)  # a write still going on when stop() would requeue the job
        return run(job)  # type: ignore[arg-type]

    monkeypatch.setattr(state_module.SaveJob, "run", slow_write)
    state = state_module.TrainingState(tmp_path, model=nn.Linear(2, 2))
    state.step = 7
    with state:
        with Preemption(env={}) as preemption, pytest.raises(Preempted):
            preemption.stop(state)
        info, _ = newest(tmp_path)  # before the state's close, which would wait too
        assert info is not None
        assert info.step == 7


def test_a_requeue_signal_under_slurm_requeues_this_job_through_scontrol(tmp_path: Path) -> None:
    bin_dir = _fake_scontrol(tmp_path / "bin")
    env = {"SLURM_JOB_ID": "4242", "PATH": str(bin_dir)}
    with Preemption(env=env) as preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.should_stop()
        with pytest.raises(Preempted) as stopped:
            preemption.stop(None)
    assert (bin_dir / "scontrol.args").read_text().split() == ["requeue", "4242"]
    assert stopped.value.requeue is not None
    assert stopped.value.requeue.done


def test_sigterm_saves_and_stops_without_requeueing_a_cancelled_job(tmp_path: Path) -> None:
    bin_dir = _fake_scontrol(tmp_path / "bin")
    env = {"SLURM_JOB_ID": "4242", "PATH": str(bin_dir)}
    with Preemption(env=env) as preemption:
        os.kill(os.getpid(), signal.SIGTERM)  # scancel
        assert preemption.should_stop()
        with pytest.raises(Preempted) as stopped:
            preemption.stop(None)
    assert not (bin_dir / "scontrol.args").exists()
    assert stopped.value.requeue is None


def test_a_requeue_slurm_refuses_is_reported_and_the_exit_code_stays(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "4242", "PATH": str(_fake_scontrol(tmp_path / "bin", code=1))}
    with Preemption(env=env) as preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.should_stop()
        with pytest.raises(Preempted) as stopped:
            preemption.stop(None)
    assert stopped.value.requeue is not None
    assert not stopped.value.requeue.done
    assert "4242" in stopped.value.requeue.reason
    assert stopped.value.code == PREEMPTED_EXIT_CODE


def test_without_scontrol_the_exit_code_is_left_for_the_batch_script(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "4242", "PATH": str(tmp_path)}
    with Preemption(env=env) as preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.should_stop()
        with pytest.raises(Preempted) as stopped:
            preemption.stop(None)
    assert stopped.value.requeue is not None
    assert "no scontrol" in stopped.value.requeue.reason


@pytest.mark.parametrize(
    "signals",
    [
        (signal.SIGUSR1, signal.SIGTERM),
        (signal.SIGTERM, signal.SIGUSR1),
        (signal.SIGUSR1, signal.SIGUSR1),
    ],
    ids=lambda s: "-then-".join(signal.Signals(n).name for n in s),
)
def test_two_signals_before_a_check_stop_once_and_a_requeue_signal_among_them_requeues_once(
    tmp_path: Path, signals: tuple[int, int]
) -> None:
    bin_dir = work.fake_scontrol(tmp_path / "bin")
    stops: list[int] = []
    with Preemption(env={"SLURM_JOB_ID": "4242", "PATH": str(bin_dir)}) as preemption:
        for step in range(10):
            if step == 3:
                for signum in signals:
                    os.kill(os.getpid(), signum)
            if preemption.should_stop():
                stops.append(step)
                with pytest.raises(Preempted) as stopped:
                    preemption.stop(None)
                break
    assert stops == [3]
    assert preemption.received is signal.SIGUSR1
    assert stopped.value.code == PREEMPTED_EXIT_CODE
    assert stopped.value.requeue is not None
    assert stopped.value.requeue.done
    assert (bin_dir / "calls").read_text().splitlines() == ["requeue 4242"]


def test_two_stop_signals_without_a_requeue_signal_stop_once_without_a_requeue(
    tmp_path: Path,
) -> None:
    bin_dir = work.fake_scontrol(tmp_path / "bin")
    with Preemption(env={"SLURM_JOB_ID": "4242", "PATH": str(bin_dir)}) as preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.should_stop()
        with pytest.raises(Preempted) as stopped:
            preemption.stop(None)
    assert stopped.value.requeue is None
    assert not (bin_dir / "calls").exists()


def test_a_signal_during_the_save_is_only_noted_and_the_stop_happens_once(tmp_path: Path) -> None:
    bin_dir = work.fake_scontrol(tmp_path / "bin")
    saved: list[str] = []

    def save() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # scancel's copy, or torchrun's, while saving
        saved.append("saved")

    with Preemption(env={"SLURM_JOB_ID": "4242", "PATH": str(bin_dir)}) as preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.should_stop()
        with pytest.raises(Preempted) as stopped:
            preemption.stop(save)
    assert saved == ["saved"]
    assert stopped.value.code == PREEMPTED_EXIT_CODE
    assert (bin_dir / "calls").read_text().splitlines() == ["requeue 4242"]


def test_a_signal_between_micro_batches_stops_at_the_one_that_closes_the_step(
    tmp_path: Path,
) -> None:
    # The documented loop, prepare(..., accumulate=2), signalled after the first micro-batch
    # of the second optimizer step: the save must wait for the second.
    bin_dir = work.fake_scontrol(tmp_path / "bin")
    run = str(tmp_path / "run")
    stopped = work.segment(0, run, str(bin_dir), signal_at=3, signalled=0)
    assert stopped["stepped_at_signal"] == [False]  # the signal came between micro-batches
    assert (stopped["micro"], stopped["stepped"], stopped["step"]) == (4, True, 2)
    assert stopped["code"] == PREEMPTED_EXIT_CODE
    assert stopped["requeue"] == (True, f"scontrol requeue {work.JOB_ID}")
    assert (bin_dir / "calls").read_text().splitlines() == [f"requeue {work.JOB_ID}"]
    resumed = work.segment(0, run)
    whole = work.segment(0, str(tmp_path / "whole"))
    assert resumed["resumed"] == 2
    assert resumed["weights"] == whole["weights"]


def _train(
    micro_batches: int, train_step: TrainStep, signal_at: int, check: Preemption
) -> list[bool]:
    """Run ``micro_batches`` micro-batches through ``train_step``, signalling this process
    after micro-batch ``signal_at``; what ``check.should_stop()`` answered after each."""
    answers: list[bool] = []
    model = train_step.model
    for micro in range(micro_batches):
        train_step(model(torch.ones(1, 2, dtype=torch.float64)).sum())
        if micro == signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        answers.append(check.should_stop())
        if answers[-1]:
            break
    return answers


@pytest.mark.parametrize("given", ["training state", "training step"])
def test_a_training_state_or_step_given_to_preemption_holds_its_stops_to_step_boundaries(
    tmp_path: Path, given: str
) -> None:
    model = nn.Linear(2, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = TrainStep(model, optimizer, accumulate=3)  # no loader: it counts calls
    state = TrainingState(tmp_path, model=model, optimizer=optimizer, train_step=train_step)
    source = state if given == "training state" else train_step
    with state, Preemption(env={}, state=source) as preemption:
        # Micro-batch 3 opens the second optimizer step; 5 closes it.
        assert _train(9, train_step, 3, preemption) == [False] * 5 + [True]
        with pytest.raises(Preempted) as stopped:
            preemption.stop(state)
    assert stopped.value.checks == 6
    assert state.wait() is not None


def test_stop_between_micro_batches_is_refused_before_anything_is_saved(tmp_path: Path) -> None:
    model = nn.Linear(2, 1).double()
    train_step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    saved: list[str] = []
    with Preemption(env={}, state=train_step) as preemption:
        train_step(model(torch.ones(1, 2, dtype=torch.float64)).sum())  # 1 of 2
        with pytest.raises(InvalidArgumentError, match="between the micro-batches"):
            preemption.stop(lambda: saved.append("saved"))
    assert saved == []


def test_a_state_without_a_training_step_is_refused_when_made() -> None:
    with pytest.raises(InvalidArgumentError, match="training step"):
        Preemption(state=object())  # type: ignore[arg-type]


def _mine(signum: int, frame: FrameType | None) -> None:
    pass


def _fail_inside(preemption: Preemption) -> None:
    with preemption:
        assert signal.getsignal(signal.SIGUSR1) == preemption._note
        raise RuntimeError("the loop failed")


def test_close_gives_back_the_handlers_that_were_there_before() -> None:
    before = signal.signal(signal.SIGUSR1, _mine)
    term = signal.getsignal(signal.SIGTERM)  # whatever the test run has there (not always SIG_DFL)
    try:
        preemption = Preemption(env={})
        with pytest.raises(RuntimeError, match="the loop failed"):
            _fail_inside(preemption)
        assert signal.getsignal(signal.SIGUSR1) is _mine
        assert signal.getsignal(signal.SIGTERM) is term
    finally:
        signal.signal(signal.SIGUSR1, before)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"signals": ()}, "no signal"),
        ({"signals": "SIGUSR1"}, "not a collection"),
        ({"signals": [signal.SIGKILL]}, "no process can handle"),
        ({"signals": [10_000]}, "no signal of this system"),
        ({"signals": [signal.SIGTERM], "requeue_on": [signal.SIGUSR1]}, "not among"),
        ({"requeue": "no"}, "not True or False"),
    ],
)
def test_signals_that_cannot_work_are_refused_when_made(
    kwargs: dict[str, object], says: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=says):
        Preemption(**kwargs)  # type: ignore[arg-type]


_SCRIPT = """
import os, pathlib, signal, sys
from gpukit.train.preempt import Preemption
out = pathlib.Path(sys.argv[1])
with Preemption() as preemption:
    for step in range(100):
        if step == 5:
            os.kill(os.getpid(), signal.SIGUSR1)
        if preemption.should_stop():
            preemption.stop(lambda: out.write_text(str(step)))
"""


def test_a_preempted_script_exits_75_after_saving_without_a_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "saved")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == PREEMPTED_EXIT_CODE, done.stderr
    assert (tmp_path / "saved").read_text() == "5"
    assert "Traceback" not in done.stderr
