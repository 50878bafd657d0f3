"""What preemption promises in one process, beyond the main loop of ``test_preempt.py``.

- Each refusal, asserted whole: its message and its hint are what the user reads.
- Which signal is noted when several come, and which training step bounds the stops when loops
  over prepared loaders nest.
- What becomes of the request to requeue: read from this process's environment by default,
  never made with ``requeue=False``, and every way ``scontrol`` can fail, reported in words.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpukit.errors import InvalidArgumentError
from gpukit.train import TrainingState, TrainStep
from gpukit.train.context import StepContext, loader_pass
from gpukit.train.preempt import PREEMPTED_EXIT_CODE, Preempted, Preemption, Requeue

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import preempt_accumulate as work

JOB_ID = "4242"


def _refused(what: str) -> Any:
    """``pytest.raises`` for an ``InvalidArgumentError`` whose message and hint are ``what``."""
    return pytest.raises(InvalidArgumentError, match=f"^{re.escape(what)}$")


def _scontrol(folder: Path, body: str) -> dict[str, str]:
    """An environment of Slurm job ``JOB_ID`` whose ``scontrol`` is the shell script ``body``."""
    folder.mkdir(parents=True, exist_ok=True)
    program = folder / "scontrol"
    program.write_text(f"#!/bin/sh\n{body}\n")
    program.chmod(0o755)
    return {"SLURM_JOB_ID": JOB_ID, "PATH": str(folder)}


def _requeue_after_sigusr1(preemption: Preemption) -> Requeue | None:
    """Signal SIGUSR1 to this process, stop at the next check; what became of the requeue."""
    with preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.should_stop()
        with pytest.raises(Preempted) as stopped:
            preemption.stop(None)
    assert stopped.value.code == PREEMPTED_EXIT_CODE
    return stopped.value.requeue


# --- refusals, whole ---------------------------------------------------------------------------

_USE_NAMES = "Use the signal module's names: signal.SIGUSR1, signal.SIGTERM."


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"signals": ()},
            "Preemption(signals=()) was given no signal to stop on. Leave the default (SIGUSR1, "
            "SIGTERM) or name the signals your scheduler sends, e.g. signals=[signal.SIGUSR1].",
        ),
        (
            {"signals": "SIGUSR1"},
            "Preemption(signals='SIGUSR1') is not a collection of signals. Pass signals, e.g. "
            "signals=[signal.SIGUSR1, signal.SIGTERM].",
        ),
        (
            {"requeue_on": "SIGUSR1"},
            "Preemption(requeue_on='SIGUSR1') is not a collection of signals. Pass signals, e.g. "
            "requeue_on=[signal.SIGUSR1, signal.SIGTERM].",
        ),
        (
            {"signals": [True]},
            f"Preemption(signals=...) holds True, which is not a signal. {_USE_NAMES}",
        ),
        (
            {"requeue_on": ["SIGUSR1"]},
            f"Preemption(requeue_on=...) holds 'SIGUSR1', which is not a signal. {_USE_NAMES}",
        ),
        (
            {"signals": [10_000]},
            f"Preemption(signals=...) holds 10000, which is no signal of this system. {_USE_NAMES}",
        ),
        (
            {"signals": [signal.SIGKILL]},
            "Preemption(signals=...) holds SIGKILL, which no process can handle. Ask the "
            "scheduler for a signal before the kill: sbatch --signal=USR1@90.",
        ),
        (
            {"signals": [signal.SIGINT, signal.SIGTERM], "requeue_on": [signal.SIGUSR1, 12]},
            "Preemption(requeue_on=...) names SIGUSR1, SIGUSR2, which is not among the signals "
            "it stops on (SIGINT, SIGTERM). Add it to signals=..., or leave it out of requeue_on.",
        ),
        (
            {"requeue": "no"},
            "requeue='no' (a str) is not True or False. Pass requeue=True or requeue=False: any "
            'other value is refused, because a string such as "no" or "false" would otherwise '
            "count as true.",
        ),
        (
            {"state": object()},
            "Preemption(state=...) got a object, which is neither a training state nor a "
            "training step, so the stops cannot wait for the end of an optimizer step. Pass the "
            "gk.TrainingState the loop saves, or its gk.train.TrainStep; or leave state out in "
            "a loop over a prepared loader.",
        ),
    ],
    ids=[
        "no-signals",
        "signals-a-string",
        "requeue_on-a-string",
        "a-bool",
        "a-name",
        "no-such-number",
        "sigkill",
        "requeue-signals-not-stopped-on",
        "requeue-not-a-bool",
        "state-without-a-step",
    ],
)
def test_each_refused_argument_says_what_was_given_and_what_to_pass_instead(
    kwargs: dict[str, object], message: str
) -> None:
    with _refused(message):
        Preemption(**kwargs)  # type: ignore[arg-type]


def test_installing_twice_is_refused_and_close_still_gives_back_the_handlers_before() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    preemption = Preemption(env={})
    with preemption:
        with _refused(
            "Preemption.install() was called twice: its handlers are installed already. "
            "Install it once (or use `with Preemption() as p:`), close() it after."
        ):
            preemption.install()
        assert signal.getsignal(signal.SIGUSR1) == preemption._note
    assert signal.getsignal(signal.SIGUSR1) is before


def test_installing_in_another_thread_names_the_thread_and_says_where_to_install() -> None:
    caught: list[BaseException] = []

    def install() -> None:
        try:
            Preemption(env={}).install()
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=install, name="loader")
    thread.start()
    thread.join()
    assert [type(exc) for exc in caught] == [InvalidArgumentError]
    assert str(caught[0]) == (
        "Preemption.install() was called in thread 'loader': Python runs signal handlers only "
        "in the main thread, so the signals would never be noted. Create and enter the "
        "Preemption in the main thread, around the training loop; should_stop() and stop() "
        "may then run in any thread."
    )
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # nothing was installed


# --- which signal, which step --------------------------------------------------------------------


def test_without_requeue_signals_the_first_stop_signal_is_the_one_noted() -> None:
    with Preemption([signal.SIGTERM, signal.SIGUSR1], requeue_on=[], env={}) as preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.received is signal.SIGTERM
        assert preemption.should_stop()


def test_a_training_state_given_to_stop_alone_refuses_a_save_between_micro_batches(
    tmp_path: Path,
) -> None:
    # No state given to Preemption and no prepared loader: the state given to stop() bounds it.
    model = nn.Linear(2, 1).double()
    train_step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    state = TrainingState(tmp_path, model=model, train_step=train_step)
    with state, Preemption(env={}) as preemption:
        train_step(model(torch.ones(1, 2, dtype=torch.float64)).sum())  # 1 of 2
        with _refused(
            "Preemption.stop() was called between the micro-batches of an optimizer step: a "
            "save now would lose their accumulated gradients. Call stop() when should_stop() "
            "said True, which it says only once the step's last micro-batch is done (the "
            "result of dist.step(...) is true)."
        ):
            preemption.stop(state)
    assert state.wait() is None  # nothing was saved


def test_an_evaluation_loop_inside_a_training_step_does_not_let_the_step_be_cut() -> None:
    # The training loader's pass is mid-step; a loader without a training step (evaluation)
    # is iterated inside it: the stop waits for the training step, not the evaluation's batch.
    training, evaluation = StepContext(2), StepContext()
    window = work.Window()
    training.train_step = window
    with Preemption(env={}) as preemption, loader_pass(training), loader_pass(evaluation):
        window.mid = True
        os.kill(os.getpid(), signal.SIGUSR1)
        assert not preemption.should_stop()
        window.mid = False
        assert preemption.should_stop()


# --- the requeue ---------------------------------------------------------------------------------


def test_the_slurm_job_is_read_from_this_process_environment_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = work.fake_scontrol(tmp_path / "bin")
    monkeypatch.setenv("SLURM_JOB_ID", JOB_ID)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    requeue = _requeue_after_sigusr1(Preemption())
    assert requeue == Requeue(True, f"scontrol requeue {JOB_ID}")
    assert (bin_dir / "calls").read_text().splitlines() == [f"requeue {JOB_ID}"]


def test_requeue_false_never_asks_slurm(tmp_path: Path) -> None:
    bin_dir = work.fake_scontrol(tmp_path / "bin")
    env = {"SLURM_JOB_ID": JOB_ID, "PATH": str(bin_dir)}
    assert _requeue_after_sigusr1(Preemption(requeue=False, env=env)) is None
    assert not (bin_dir / "calls").exists()


def test_outside_a_slurm_job_scontrol_is_not_run_and_the_reason_says_so(tmp_path: Path) -> None:
    bin_dir = work.fake_scontrol(tmp_path / "bin")
    requeue = _requeue_after_sigusr1(Preemption(env={"PATH": str(bin_dir)}))
    assert requeue == Requeue(False, "not a Slurm job (no SLURM_JOB_ID)")
    assert not (bin_dir / "calls").exists()


def test_without_scontrol_the_reason_leaves_exit_code_75_to_the_batch_script(
    tmp_path: Path,
) -> None:
    requeue = _requeue_after_sigusr1(Preemption(env={"SLURM_JOB_ID": JOB_ID, "PATH": "/nowhere"}))
    assert requeue == Requeue(False, "no scontrol on PATH: exit code 75 is the script's")


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (
            "echo 'scontrol: error: Requested operation is presently disabled' >&2\nexit 1",
            "scontrol: error: Requested operation is presently disabled",
        ),
        ("echo '  Invalid job id specified  '\nexit 1", "Invalid job id specified"),
        ("exit 3", "exit 3"),
    ],
    ids=["on-stderr", "on-stdout", "silent"],
)
def test_a_refused_requeue_reports_what_scontrol_said_or_its_exit_code(
    tmp_path: Path, body: str, said: str
) -> None:
    requeue = _requeue_after_sigusr1(Preemption(env=_scontrol(tmp_path / "bin", body)))
    assert requeue == Requeue(False, f"scontrol requeue {JOB_ID}: {said}")


def test_an_scontrol_that_never_answers_is_given_up_on_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # scontrol waits on slurmctld; one that hangs must not keep the job from exiting. The
    # time limit is shortened here, and a call without one is a failure.
    run = subprocess.run

    def shortened(*args: Any, **kwargs: Any) -> Any:
        assert kwargs.get("timeout") is not None, "scontrol was run without a time limit"
        return run(*args, **{**kwargs, "timeout": 0.2})

    monkeypatch.setattr(subprocess, "run", shortened)
    requeue = _requeue_after_sigusr1(Preemption(env=_scontrol(tmp_path / "bin", "exec sleep 30")))
    assert requeue is not None
    assert requeue.done is False
    assert requeue.reason.startswith(f"scontrol requeue {JOB_ID} failed: Command ")
    assert requeue.reason.endswith("timed out after 0.2 seconds")
