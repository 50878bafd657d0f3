"""Real Open MPI: mpirun alone, two at once on one host, and inside a Slurm step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.conftest import TRAIN, assert_ok, assert_one_training, job_env
from tests.cluster.slurm import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-x", "PYTHONPATH", "-x"]


def _mpirun(out: Path, *options: str) -> list[str]:
    return [*MPIRUN, "OMP_NUM_THREADS", *options, "-np", "2", "python", str(TRAIN), str(out)]


def test_mpirun_with_master_addr_trains_like_one_process_even_two_at_once_on_one_host(
    one_node: Cluster, single_weights: list[float], tmp_path: Path
) -> None:
    # Both used port 29500: the second failed to bind it, or joined the first one's group.
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    both = " & ".join(
        " ".join(_mpirun(out, "-x", "MASTER_ADDR=127.0.0.1")) for out in (first, second)
    )
    done = one_node.run("bash", "-c", f"{both} & wait -n && wait -n", env=job_env())
    assert_ok(done)
    assert_one_training(first, 2, single_weights, source="mpi")
    assert_one_training(second, 2, single_weights, source="mpi")


def test_mpirun_in_a_one_task_step_is_one_world_not_two_trainings(
    one_node: Cluster, single_weights: list[float], tmp_path: Path
) -> None:
    # What typing mpirun in an interactive step does: its ranks inherit SLURM_NTASKS=1.
    done = one_node.run(
        "srun", "-n1", "-c2", *_mpirun(tmp_path, "-x", "MASTER_ADDR=node0"), env=job_env()
    )
    assert_ok(done)
    assert_one_training(tmp_path, 2, single_weights, source="mpi")
