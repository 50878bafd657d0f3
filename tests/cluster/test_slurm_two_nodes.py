"""A real two-node Slurm (n1, n2 on a private link): tasks spread over nodes train as one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import TRAIN, assert_ok, assert_one_training, job_env, read_results
from tests.cluster.slurm import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.parametrize(
    ("tasks", "hosts"),
    [
        (["-n2"], ["n1", "n2"]),  # one task per node
        (["--ntasks-per-node=2"], ["n1", "n1", "n2", "n2"]),
        (["--ntasks-per-node=2", "-n3"], ["n1", "n1", "n2"]),  # uneven: 2 + 1
    ],
)
def test_srun_over_two_nodes_trains_like_one_process(
    two_nodes: Cluster,
    single_weights: list[float],
    tmp_path: Path,
    tasks: list[str],
    hosts: list[str],
) -> None:
    done = two_nodes.run(
        "srun", "-N2", *tasks, sys.executable, str(TRAIN), str(tmp_path), env=job_env()
    )
    assert_ok(done)
    results = assert_one_training(tmp_path, len(hosts), single_weights)
    assert [r["host"] for r in results] == hosts


def test_srun_one_task_per_node_running_gpukit_run_ddp_trains_like_one_process(
    two_nodes: Cluster, single_weights: list[float], tmp_path: Path
) -> None:
    done = two_nodes.run(
        "srun", "-N2", "--ntasks-per-node=1",
        sys.executable, "-m", "gpukit", "run", "--ddp", "--cpu-ok", "-n", "2", "--",
        "python", str(TRAIN), str(tmp_path),
        env=job_env(),
    )  # fmt: skip
    assert_ok(done)
    results = assert_one_training(tmp_path, 4, single_weights, source="torchrun")
    assert [r["host"] for r in results] == ["n1", "n1", "n2", "n2"]
    assert "node_rank is only used for static" not in done.stderr  # torchrun warned: ignored


def test_mpirun_inside_a_two_node_allocation_trains_like_one_process(
    two_nodes: Cluster, single_weights: list[float], tmp_path: Path
) -> None:
    # mpirun starts its daemon on n2 with srun: rank 1 inherits that step's SLURM_NTASKS=1.
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "mpirun --allow-run-as-root -np 2 --map-by node -x MASTER_ADDR=n1 -x PYTHONPATH "
        f"-x OMP_NUM_THREADS python {TRAIN} {tmp_path}\n"
    )
    output = tmp_path / "job.out"
    state = two_nodes.batch(script, "-N2", "-n2", f"--output={output}", env=job_env())
    assert state == "COMPLETED", output.read_text()[-3000:]
    results = assert_one_training(tmp_path, 2, single_weights, source="mpi")
    assert [r["host"] for r in results] == ["n1", "n2"]


def test_ranks_placed_arbitrarily_refuse_at_once_instead_of_hanging(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n2\nn1\n")  # rank 0 on n2, the second host of the node list
    done = two_nodes.run(
        "srun", "-n2", "-m", "arbitrary", "-w", str(hostfile),
        sys.executable, str(TRAIN), str(tmp_path),
        env=job_env(), timeout=120,
    )  # fmt: skip
    assert done.returncode not in (0, 124), done.stderr[-3000:]
    assert done.stderr.count("SLURM_DISTRIBUTION=arbitrary") == 2, done.stderr[-3000:]
    assert read_results(tmp_path) == []
