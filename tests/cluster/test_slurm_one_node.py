"""A real one-node Slurm: srun, sbatch, salloc and gpukit run --ddp train like one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import TRAIN, assert_one_training, job_env, read_results
from tests.cluster.slurm import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _ok(done: object) -> None:
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])  # type: ignore[attr-defined]


def test_srun_n2_trains_like_one_process(
    one_node: Cluster, single_weights: list[float], tmp_path: Path
) -> None:
    done = one_node.run("srun", "-n2", sys.executable, str(TRAIN), str(tmp_path), env=job_env())
    _ok(done)
    results = assert_one_training(tmp_path, 2, single_weights)
    assert [r["local_rank"] for r in results] == [0, 1]
    assert {r["backend"] for r in results} == {"gloo"}


def test_sbatch_script_is_one_process_and_its_srun_trains_like_one(
    one_node: Cluster, single_weights: list[float], tmp_path: Path
) -> None:
    alone, together = tmp_path / "alone", tmp_path / "together"
    alone.mkdir()
    together.mkdir()
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --ntasks=2\n"
        f"python {TRAIN} {alone}\n"  # the batch script itself: one process, not rank 0 of 2
        f"srun python {TRAIN} {together}\n"
        "echo job done\n"
    )
    output = tmp_path / "job.out"
    done = one_node.run("sbatch", "--wait", f"--output={output}", str(script), env=job_env())
    _ok(done)
    assert "job done" in output.read_text()
    assert_one_training(alone, 1, single_weights, source=None)
    assert_one_training(together, 2, single_weights)


def test_salloc_shell_and_an_interactive_step_are_one_process(
    one_node: Cluster, single_weights: list[float], tmp_path: Path
) -> None:
    shell, step = tmp_path / "shell", tmp_path / "step"
    shell.mkdir()
    step.mkdir()
    # `srun --pty bash`, where the user types `python train.py`: a step of one task with a
    # terminal (given here by `script`), in an allocation of two tasks.
    typed = f"python {TRAIN} {step}"
    inner = f"srun -n1 --pty bash -c {typed!r}"
    done = one_node.run(
        "salloc", "-n2", "bash", "-c",
        f"python {TRAIN} {shell} && script -qec {inner!r} /dev/null",
        env=job_env(),
    )  # fmt: skip
    _ok(done)
    assert_one_training(shell, 1, single_weights, source=None)
    assert_one_training(step, 1, single_weights, source=None)


def test_srun_one_task_running_gpukit_run_ddp_trains_like_one_process(
    one_node: Cluster, single_weights: list[float], tmp_path: Path
) -> None:
    done = one_node.run(
        "srun", "--ntasks-per-node=1", "-n1",
        sys.executable, "-m", "gpukit", "run", "--ddp", "--cpu-ok", "-n", "2", "--",
        "python", str(TRAIN), str(tmp_path),
        env=job_env(),
    )  # fmt: skip
    _ok(done)
    results = assert_one_training(tmp_path, 2, single_weights, source="torchrun")
    assert {r["host"] for r in results} == {"node0"}
    assert len(read_results(tmp_path)) == 2
