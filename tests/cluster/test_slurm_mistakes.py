"""A real Slurm, used the ways that went wrong: each is refused at once or works, never hangs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import TRAIN, assert_one_training, job_env, read_results
from tests.cluster.slurm import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_gpukit_run_ddp_in_two_tasks_of_one_node_is_refused_as_a_usage_error(
    one_node: Cluster, tmp_path: Path
) -> None:
    done = one_node.run(
        "srun", "-N1", "-n2",
        sys.executable, "-m", "gpukit", "run", "--ddp", "--cpu-ok", "-n", "2", "--",
        "python", str(TRAIN), str(tmp_path),
        env=job_env(),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("srun --ntasks-per-node=1") == 2  # both tasks say what works
    assert read_results(tmp_path) == []


def test_every_rank_refuses_local_ranks_beyond_the_visible_gpus_within_seconds(
    one_node: Cluster, tmp_path: Path
) -> None:
    # Rank 1 has no cuda:1; rank 0 waited for it in the rendezvous until killed.
    done = one_node.run(
        "srun", "-n2", sys.executable, str(TRAIN), str(tmp_path),
        env=job_env(CUDA_VISIBLE_DEVICES="0"), timeout=90,
    )  # fmt: skip
    assert done.returncode not in (0, 124), done.stderr[-3000:]
    assert done.stderr.count("CUDA_VISIBLE_DEVICES=0 lets each process see 1 GPU") == 2


def test_two_steps_of_one_job_at_once_train_apart(
    one_node: Cluster, single_weights: list[float], tmp_path: Path
) -> None:
    # Both steps derived one port from the job id: the second crashed, or joined the first.
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"srun -n2 --exact python {TRAIN} {first} &\n"
        f"srun -n2 --exact python {TRAIN} {second} &\n"
        "wait -n && wait -n\n"
    )
    output = tmp_path / "job.out"
    state = one_node.batch(script, "-n4", f"--output={output}", env=job_env())
    assert state == "COMPLETED", output.read_text()[-3000:]
    assert_one_training(first, 2, single_weights)
    assert_one_training(second, 2, single_weights)
