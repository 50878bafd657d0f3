"""``gpukit pick``, ``run`` and ``list`` inside a job: only the granted GPUs, said plainly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gpukit.gpus.inventory import inventory
from gpukit.sharing.claims import claim
from tests.helpers import CliRunner

A100 = "server-8xA100-shared"  # 8 alike GPUs; only 2 and 4 idle


def _env(machines_dir: Path, tmp_path: Path, **extra: str | None) -> dict[str, str | None]:
    return {
        "GPUKIT_FAKE_NVML": str(machines_dir / f"{A100}.json"),
        "GPUKIT_LOCK_DIR": str(tmp_path / "locks"),
        **extra,
    }


def test_pick_under_cuda_visible_devices_prints_the_nvidia_smi_index(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    done = run_cli("pick", env=_env(machines_dir, tmp_path, CUDA_VISIBLE_DEVICES="4"))
    assert (done.returncode, done.stdout) == (0, "4\n")


def test_pick_json_adds_what_this_process_calls_the_gpu(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    env = _env(machines_dir, tmp_path, CUDA_VISIBLE_DEVICES="3,4")
    done = run_cli("pick", "--json", env=env)
    got = json.loads(done.stdout)
    assert (got["indices"], got["cuda_visible_devices"], got["cuda_indices"]) == ([4], "4", [1])


def test_pick_of_more_gpus_than_granted_exits_4_naming_the_grant(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    done = run_cli("pick", "-n", "2", env=_env(machines_dir, tmp_path, CUDA_VISIBLE_DEVICES="4"))
    assert (done.returncode, done.stdout) == (4, "")
    assert "CUDA_VISIBLE_DEVICES=4 grants this process 1 (GPU 4)" in done.stderr
    assert "Traceback" not in done.stderr


def test_pick_all_gpus_chooses_among_all_of_the_machine(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    env = _env(machines_dir, tmp_path, CUDA_VISIBLE_DEVICES="4")
    done = run_cli("pick", "-n", "2", "--all-gpus", env=env)
    assert (done.returncode, done.stdout) == (0, "2,4\n")


def test_pick_inside_a_slurm_job_uses_the_jobs_gpus(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    env = _env(machines_dir, tmp_path, SLURM_JOB_GPUS="3-5", SLURM_JOB_ID="4242")
    done = run_cli("pick", "--order", "index", env=env)
    assert (done.returncode, done.stdout) == (0, "4\n")  # 3 and 5 are busy; 2 is not the job's


def test_pick_refuses_indices_it_cannot_map_on_mixed_gpus(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    env = _env(machines_dir, tmp_path, CUDA_VISIBLE_DEVICES="0")
    env["GPUKIT_FAKE_NVML"] = str(machines_dir / "workstation-mixed-order.json")
    done = run_cli("pick", env=env)
    assert (done.returncode, done.stdout) == (2, "")
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in done.stderr


def test_run_under_cuda_visible_devices_runs_on_a_granted_gpu(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    show = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    env = _env(machines_dir, tmp_path, CUDA_VISIBLE_DEVICES="4")
    done = run_cli("run", "--", sys.executable, "-c", show, env=env)
    assert (done.returncode, done.stdout) == (0, "4\n")
    wider = run_cli("run", "--all-gpus", "--", sys.executable, "-c", show, env=env)
    assert (wider.returncode, wider.stdout) == (0, "2\n")


def test_run_wait_of_more_gpus_than_granted_fails_at_once(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    env = _env(machines_dir, tmp_path, CUDA_VISIBLE_DEVICES="4")
    done = run_cli("run", "-n", "2", "--wait", "--", "true", env=env, timeout=30)
    assert done.returncode == 4
    assert "grants this process 1" in done.stderr


def test_list_marks_the_jobs_gpus(run_cli: CliRunner, machines_dir: Path, tmp_path: Path) -> None:
    env = _env(machines_dir, tmp_path, SLURM_JOB_GPUS="4,5", SLURM_JOB_ID="4242")
    done = run_cli("list", env=env)
    assert "this job's GPUs: 4,5 (SLURM_JOB_GPUS=4,5)" in done.stdout
    as_json = json.loads(run_cli("list", "--json", env=env).stdout)
    assert as_json["granted"] == {
        "indices": [4, 5],
        "variable": "SLURM_JOB_GPUS",
        "value": "4,5",
    }


def test_run_wait_waits_only_for_a_granted_gpu(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    show = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    env = _env(machines_dir, tmp_path, CUDA_VISIBLE_DEVICES="4", GPUKIT_POLL_INTERVAL="0.05")
    done = run_cli("run", "--wait", "--settle", "1", "--", sys.executable, "-c", show, env=env)
    assert (done.returncode, done.stdout) == (0, "4\n")


def test_two_steps_of_one_slurm_job_never_take_the_same_gpu(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _env(machines_dir, tmp_path, SLURM_JOB_GPUS="2,4", SLURM_JOB_ID="4242")
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(env["GPUKIT_FAKE_NVML"]))
    # The first step holds GPU 2 through gpukit's claim, as `gpukit run` does.
    with claim([inventory().gpu(2)], folder=tmp_path / "locks", command="step 0"):
        second = run_cli("pick", "--order", "index", env=env)
        third = run_cli("pick", "-n", "2", env=env)
    assert (second.returncode, second.stdout) == (0, "4\n")
    assert third.returncode == 4
    assert "claimed by" in third.stderr


def test_run_and_pick_inside_a_grant_without_a_qualifying_gpu_say_the_same_of_it(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    machine = json.loads((machines_dir / f"{A100}.json").read_text())
    uuids = {g["index"]: g["uuid"] for g in machine["gpus"]}
    env = _env(machines_dir, tmp_path, CUDA_VISIBLE_DEVICES=f"{uuids[3]},{uuids[5]}")
    ran = run_cli("run", "--", sys.executable, "-c", "pass", env=env)
    picked = run_cli("pick", env=env)
    assert (ran.returncode, picked.returncode) == (4, 4)
    for done in (ran, picked):
        assert "granted by CUDA_VISIBLE_DEVICES: 0 of 2 qualify" in done.stderr
        assert "GPU-" not in done.stderr
        assert "excluded" not in done.stderr


def test_run_on_a_machine_with_a_lost_gpu_starts_on_the_granted_readable_one(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    env = _env(machines_dir, tmp_path, CUDA_VISIBLE_DEVICES="0")
    env["GPUKIT_FAKE_NVML"] = str(machines_dir / "kaggle-2xT4-one-lost.json")
    show = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    done = run_cli("run", "--", sys.executable, "-c", show, env=env)
    assert (done.returncode, done.stdout) == (0, "0\n"), done.stderr
    assert "numbering" not in done.stderr
