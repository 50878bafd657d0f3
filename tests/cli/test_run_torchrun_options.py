"""gpukit run --ddp --torchrun-arg: torchrun's own options, and what its restarts need."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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
