"""``gpukit pick``: indices for the shell, or nothing on stdout and a loud failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpukit.gpus.inventory import inventory
from gpukit.sharing.claims import claim
from tests.helpers import ROOT, CliRunner


def _env(machines_dir: Path, tmp_path: Path, machine: str) -> dict[str, str | None]:
    return {
        "GPUKIT_FAKE_NVML": str(machines_dir / f"{machine}.json"),
        "GPUKIT_LOCK_DIR": str(tmp_path / "locks"),
    }


def test_pick_prints_free_gpu_indices_comma_separated(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    done = run_cli("pick", "-n", "2", env=_env(machines_dir, tmp_path, "server-8xA100-shared"))
    assert (done.returncode, done.stdout) == (0, "2,4\n")


@pytest.mark.parametrize("command", ["pick", "run", "list", "queue"])
def test_each_command_says_on_stderr_that_it_reads_a_fake_machine(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path, command: str
) -> None:
    args = ["--", "true"] if command == "run" else []
    done = run_cli(command, *args, env=_env(machines_dir, tmp_path, "server-4xL4-idle"))
    assert done.returncode == 0, done.stderr
    assert f"gpukit {command}: reading a fake machine" in done.stderr
    assert "server-4xL4-idle.json" in done.stderr


def test_the_fake_machine_banner_is_written_in_one_place() -> None:
    # One function says it, so that every command says it alike.
    src = ROOT / "src" / "gpukit"
    places = [p.name for p in src.rglob("*.py") if "reading a fake machine" in p.read_text()]
    assert places == ["_output.py"]


def test_pick_prints_nothing_and_exits_4_when_too_few_qualify(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    env = _env(machines_dir, tmp_path, "server-8xA100-shared")
    done = run_cli("pick", "-n", "5", "--min-free", "60GiB", env=env)
    assert (done.returncode, done.stdout) == (4, "")
    assert "GPU 3: 41 GiB free < 60 GiB; 1 process (bob, jupyter-kernel)" in done.stderr
    assert "Traceback" not in done.stderr


def test_pick_json_names_indices_and_uuids_under_a_schema(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    done = run_cli("pick", "--json", env=_env(machines_dir, tmp_path, "kaggle-2xT4-idle"))
    payload = json.loads(done.stdout)
    assert payload["schema"] == "gpukit.pick/1"
    assert payload["indices"] == [0]
    assert payload["uuids"][0].startswith("GPU-6513270e")


def test_pick_skips_a_gpu_another_gpukit_process_claimed(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _env(machines_dir, tmp_path, "kaggle-2xT4-idle")
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(env["GPUKIT_FAKE_NVML"]))
    with claim([inventory().gpu(0)], folder=tmp_path / "locks"):
        done = run_cli("pick", env=env)
    assert (done.returncode, done.stdout) == (0, "1\n")


def test_pick_excludes_listed_gpus(run_cli: CliRunner, machines_dir: Path, tmp_path: Path) -> None:
    env = _env(machines_dir, tmp_path, "server-4xL4-idle")
    done = run_cli("pick", "-n", "2", "--exclude", "0,2", "--order", "index", env=env)
    assert done.stdout == "1,3\n"


def test_pick_without_a_driver_exits_3(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    done = run_cli("pick", env=_env(machines_dir, tmp_path, "no-driver"))
    assert (done.returncode, done.stdout) == (3, "")
    assert "No NVIDIA driver" in done.stderr


def test_pick_with_an_unreadable_size_is_a_usage_error(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    env = _env(machines_dir, tmp_path, "kaggle-2xT4-idle")
    done = run_cli("pick", "--min-free", "lots", env=env)
    assert (done.returncode, done.stdout) == (2, "")
    assert "'lots'" in done.stderr
