"""gpukit run --ddp --torchrun-arg: torchrun's own options, and what its restarts need."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gpukit.cli.main import main
from gpukit.distributed.torchrun import RESTART_STORE_VAR, SIGNALS_VAR, ddp_command, ddp_env
from gpukit.supervise import FORWARDED
from tests.helpers import ROOT, CliRunner, run_python

SCRIPTS = ROOT / "tests" / "distributed" / "scripts"


def test_torchrun_options_follow_gpukits_so_that_they_win() -> None:
    argv = ddp_command(["python", "train.py"], 2, ["--max-restarts=3", "--nnodes=1:4"])
    assert argv[3:] == [
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=3",
        "--nnodes=1:4",
        "train.py",
    ]


@pytest.mark.parametrize(
    "options",
    [["--max-restarts=2"], ["--max_restarts=1"], ["--max-restarts", "3"]],
)
def test_restarts_set_what_a_restarted_group_needs(options: list[str]) -> None:
    assert ddp_env(options, {"PATH": "/bin"})[RESTART_STORE_VAR] == "1"


def test_restarts_asked_for_in_torchruns_own_variable_count_too() -> None:
    assert ddp_env([], {"PET_MAX_RESTARTS": "2"})[RESTART_STORE_VAR] == "1"


def test_no_restarts_leave_the_store_shared() -> None:
    env = {"PATH": "/bin"}
    assert RESTART_STORE_VAR not in ddp_env(["--max-restarts=0", "--rdzv-conf=timeout=60"], env)


def test_torchrun_is_told_to_pass_every_signal_gpukit_forwards_to_its_workers() -> None:
    # torch's default leaves out SIGUSR1/SIGUSR2: torchrun died of them, its workers ran on.
    told = ddp_env([], {"PATH": "/bin"})[SIGNALS_VAR].split(",")
    assert set(told) == {s.name for s in FORWARDED}


def test_a_signal_list_of_the_users_own_wins() -> None:
    assert ddp_env([], {SIGNALS_VAR: "SIGTERM"})[SIGNALS_VAR] == "SIGTERM"


def test_a_store_setting_of_the_users_own_wins() -> None:
    env = {RESTART_STORE_VAR: "0"}
    assert ddp_env(["--max-restarts=1"], env)[RESTART_STORE_VAR] == "0"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--torchrun-arg=--max-restarts=1"], "without --ddp"),
        (["--ddp", "--torchrun-arg=--nproc-per-node=8"], "with -n N"),
        (["--ddp", "--torchrun-arg=train.py"], "not a torchrun option"),
    ],
)
def test_torchrun_options_that_cannot_work_are_usage_errors(
    run_cli: CliRunner, machines_dir: Path, args: list[str], says: str
) -> None:
    env: dict[str, str | None] = {"GPUKIT_FAKE_NVML": str(machines_dir / "no-driver.json")}
    done = run_cli("run", "--cpu-ok", "-n", "1", *args, "--", "python", "x.py", env=env)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr


def test_the_help_says_how_to_give_torchrun_options(run_cli: CliRunner) -> None:
    out = run_cli("run", "--help").stdout
    assert "--torchrun-arg" in out
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in " ".join(out.split())


@pytest.mark.slow
def test_a_worker_that_dies_is_restarted_and_the_run_trains_like_one_process(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    env: dict[str, str | None] = {
        "GPUKIT_FAKE_NVML": str(machines_dir / "no-driver.json"),
        "PYTHONPATH": str(SCRIPTS),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": None,
        "MASTER_PORT": None,
    }
    done = run_cli(
        "run", "--ddp", "--cpu-ok", "-n", "2", "--torchrun-arg=--max-restarts=1",
        "--torchrun-arg=--monitor-interval=0.2", "--",
        sys.executable, str(SCRIPTS / "restart_once.py"), str(tmp_path),
        env=env, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["restart"]) for r in ranks] == [(0, 2, 1), (1, 2, 1)]
    single_weights = json.loads(
        run_python(
            "import json, workloads; print(json.dumps(workloads.train()))",
            PYTHONPATH=str(SCRIPTS),
            OMP_NUM_THREADS="1",
        )
    )
    for rank in ranks:
        assert rank["weights"] == pytest.approx(single_weights, rel=0, abs=1e-12)


# Each start of a worker is noted; then it stops for preemption (75), as gk.train.Preemption
# does. argv: the folder for the notes.
_PREEMPTED_AT_ONCE = """
import os, pathlib, sys
pathlib.Path(sys.argv[1], f"start-{os.environ['RANK']}-{os.getpid()}").write_text("")
sys.exit(75)
"""


@pytest.mark.slow
def test_workers_that_stopped_for_preemption_are_not_restarted(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "preempted.py"
    script.write_text(_PREEMPTED_AT_ONCE)
    notes = tmp_path / "notes"
    notes.mkdir()
    env: dict[str, str | None] = {
        "GPUKIT_FAKE_NVML": str(machines_dir / "no-driver.json"),
        "MASTER_ADDR": None,
        "MASTER_PORT": None,
    }
    done = run_cli(
        "run", "--ddp", "--cpu-ok", "-n", "2", "--torchrun-arg=--max-restarts=3",
        "--torchrun-arg=--monitor-interval=0.1", "--", sys.executable, str(script), str(notes),
        env=env, timeout=240,
    )  # fmt: skip
    assert done.returncode == 75, done.stderr[-3000:]
    assert len(list(notes.iterdir())) == 2  # each rank started once


@pytest.fixture
def no_torchrun(monkeypatch: pytest.MonkeyPatch, machines_dir: Path) -> list[list[str]]:
    """Run ``gpukit run --ddp --cpu-ok`` in this process without starting torchrun: what it
    would have started is recorded instead."""
    import gpukit.cli.run

    started: list[list[str]] = []

    def supervise(argv: list[str], env: dict[str, str], **kwargs: object) -> int:
        started.append(list(argv))
        return 0

    monkeypatch.setattr(gpukit.cli.run, "supervise", supervise)
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(machines_dir / "no-driver.json"))
    return started


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ("--max-restarts=-1", "is not a whole number from 0 to 10,000"),
        ("--max_restarts=1.5", "is not a whole number from 0 to 10,000"),
        ("--max-restarts=٣", "is not a whole number from 0 to 10,000"),
        ("--monitor-interval=nan", "is not a number of seconds above 0"),
        ("--monitor-interval=inf", "is not a number of seconds above 0"),
        ("--monitor-interval=0", "is not a number of seconds above 0"),
        ("--shutdown-timeout=-5", "is not a whole number of seconds from 0"),
        ("--shutdown-timeout=1e400", "is not a whole number of seconds from 0"),
        ("--nnodes=2:1", "is not a node count from 1 to 100,000, or a range"),
        ("--nnodes=0", "is not a node count from 1 to 100,000, or a range"),
        ("--master-port=70000", "is not a port number from 1 to 65,535"),
        ("--node-rank=-1", "is not a whole number from 0 to 100,000"),
    ],
)
def test_a_number_torchrun_cannot_take_is_refused_before_torchrun_starts(
    no_torchrun: list[list[str]], capsys: pytest.CaptureFixture[str], option: str, says: str
) -> None:
    code = main(["run", "--ddp", "--cpu-ok", "-n", "1", f"--torchrun-arg={option}", "--", "true"])
    assert code == 2
    err = capsys.readouterr().err
    assert no_torchrun == []
    name, _, value = option.partition("=")
    assert err.startswith(f"gpukit run: --torchrun-arg={option}: {value!r} {says}"), err
    assert f"--torchrun-arg={name}=" in err.splitlines()[-1]  # the next step, with an example


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ("--max-restarts", "takes its value after '='"),
        ("--max-rest=-1", "write its whole name, --max-restarts"),
        ("--monitor=nan", "write its whole name, --monitor-interval"),
    ],
)
def test_a_number_option_without_its_value_or_its_whole_name_is_refused(
    no_torchrun: list[list[str]], capsys: pytest.CaptureFixture[str], option: str, says: str
) -> None:
    code = main(["run", "--ddp", "--cpu-ok", "-n", "1", f"--torchrun-arg={option}", "--", "true"])
    assert code == 2
    assert says in capsys.readouterr().err
    assert no_torchrun == []


def test_a_number_from_torchruns_own_variable_is_checked_too(
    no_torchrun: list[list[str]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PET_MAX_RESTARTS", "-1")
    assert main(["run", "--ddp", "--cpu-ok", "-n", "1", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "PET_MAX_RESTARTS='-1' (torchrun's --max-restarts, from the environment)" in err
    assert no_torchrun == []


def test_an_option_given_wins_over_torchruns_own_variable(
    no_torchrun: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PET_MAX_RESTARTS", "-1")  # not read by torchrun: the option is given
    args = ["--ddp", "--cpu-ok", "-n", "1", "--torchrun-arg=--max-restarts=2", "--", "true"]
    assert main(["run", *args]) == 0
    [argv] = no_torchrun
    assert "--max-restarts=2" in argv


@pytest.mark.parametrize(
    "option",
    [
        "--max-restarts=3",
        "--max_restarts=+0",
        "--monitor-interval=0.5",
        "--monitor-interval=1e-2",
        "--shutdown-timeout=0",
        "--nnodes=1:4",
        "--nnodes=2",
        "--master-port=29500",
        "--rdzv-conf=timeout=60",
    ],
)
def test_numbers_torchrun_takes_reach_it_as_written(
    no_torchrun: list[list[str]], option: str
) -> None:
    code = main(["run", "--ddp", "--cpu-ok", "-n", "1", f"--torchrun-arg={option}", "--", "true"])
    assert code == 0
    [argv] = no_torchrun
    assert argv[argv.index(option) + 1 :] == ["--no-python", "true"]


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (["/no/such/program"], "Cannot run '/no/such/program': no such program."),
        (["no-such-program-on-path", "--flag"], "Cannot run 'no-such-program-on-path': no such"),
        (["python", "/no/such/train.py"], "Cannot run '/no/such/train.py': no such file."),
        (["{tmp}"], "Cannot run '{tmp}': Permission denied."),
        (["{tmp}/train.sh"], "Cannot run '{tmp}/train.sh': Permission denied."),
    ],
)
def test_a_program_the_workers_cannot_start_is_refused_before_torchrun_starts(
    no_torchrun: list[list[str]],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    command: list[str],
    says: str,
) -> None:
    (tmp_path / "train.sh").write_text("echo hi\n")  # not executable
    command = [arg.format(tmp=tmp_path) for arg in command]
    assert main(["run", "--ddp", "--cpu-ok", "-n", "1", "--", *command]) == 2
    err = capsys.readouterr().err
    assert says.format(tmp=tmp_path) in err
    assert "Check the command after `--`" in err
    assert no_torchrun == []


@pytest.mark.parametrize(
    "command",
    [["true"], ["python", "-m", "json.tool"], ["python", "-c", "pass"], ["{tmp}/run.sh"]],
)
def test_a_program_the_workers_can_start_is_started_under_torchrun(
    no_torchrun: list[list[str]], tmp_path: Path, command: list[str]
) -> None:
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    command = [arg.format(tmp=tmp_path) for arg in command]
    assert main(["run", "--ddp", "--cpu-ok", "-n", "1", "--", *command]) == 0
    [argv] = no_torchrun
    assert argv[-1] == command[-1]
