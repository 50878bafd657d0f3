"""What real schedulers set, read right: Open MPI inside Slurm, steps, placements, refusals.

The mappings below are the variables a real Slurm 22.05 and Open MPI 4.1 gave the processes of
the jobs named in each test (captured with ``env`` in the cluster tier's jobs, trimmed to what
gpukit reads); ``tests/cluster`` runs the same jobs for real.
"""

from __future__ import annotations

import time

import pytest

from gpukit import distributed as dist
from gpukit.distributed.environment import environment
from gpukit.errors import DistributedError
from tests.helpers import CliRunner

# `sbatch -N2 -n2` running `mpirun -np 2 --map-by node -x MASTER_ADDR=n1 python train.py`:
# rank 1 runs on n2 under the orted daemon that mpirun started there with srun (step 0).
MPIRUN_RANK_1_ON_THE_SECOND_NODE = {
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
    "OMPI_COMM_WORLD_NODE_RANK": "0",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_MCA_ess_base_jobid": "669450241",
    "MASTER_ADDR": "n1",
    "SLURM_DISTRIBUTION": "cyclic",
    "SLURM_JOB_ID": "2",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_PROCID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "n2",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_STEP_TASKS_PER_NODE": "1",
    "SLURM_TASKS_PER_NODE": "1",
}

# `srun -n1 mpirun -np 2 python train.py` (mpirun typed in an interactive step): rank 1.
MPIRUN_IN_A_ONE_TASK_STEP = {
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_MCA_ess_base_jobid": "3050831873",
    "SLURM_JOB_ID": "7",
    "SLURM_JOB_NODELIST": "node0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "1",
    "SLURM_PROCID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "node0",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_TASKS_PER_NODE": "1",
    "SLURM_TASKS_PER_NODE": "1",
}

# `srun -n2` on one node: rank 1's variables (task 1 of 2, local rank 1).
SRUN_N2_RANK_1 = {
    "SLURM_JOB_ID": "12",
    "SLURM_JOB_NODELIST": "node0",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "node0",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2",
}


def _rank(env: dict[str, str], rank: int) -> dict[str, str]:
    return {**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}


# -- Open MPI inside Slurm -------------------------------------------------------------------


def test_mpirun_inside_an_allocation_reads_open_mpis_rank_not_its_daemons_srun_step() -> None:
    e = environment(MPIRUN_RANK_1_ON_THE_SECOND_NODE)
    assert (e.source, e.rank, e.world_size, e.master_addr) == ("mpi", 1, 2, "n1")


def test_mpirun_in_a_one_task_step_is_one_world_of_two_not_two_trainings() -> None:
    ranks = [
        environment(
            {
                **MPIRUN_IN_A_ONE_TASK_STEP,
                "OMPI_COMM_WORLD_RANK": str(r),
                "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1",
            }
        )
        for r in (0, 1)
    ]
    assert [(e.source, e.rank, e.world_size) for e in ranks] == [("mpi", 0, 2), ("mpi", 1, 2)]


def test_several_mpiruns_started_by_one_srun_step_on_a_node_are_refused() -> None:
    # `srun -n2 mpirun -np 2 python train.py`: two mpiruns, two worlds that know nothing of
    # each other; each rank's Slurm step has 2 tasks on this node.
    env = {
        **_rank(SRUN_N2_RANK_1, 1),
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
    }
    with pytest.raises(DistributedError, match="each task ran its own mpirun") as info:
        environment(env)
    assert "SLURM_STEP_TASKS_PER_NODE=2" in str(info.value)
    assert "srun -n1 mpirun" in (info.value.hint or "")


def test_srun_starting_mpi_ranks_itself_agrees_with_open_mpi() -> None:
    # srun --mpi=pmix: once MPI is up, Open MPI's rank and size are srun's own.
    env = {
        **SRUN_N2_RANK_1,
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "node0",
    }
    e = environment(env)
    assert (e.rank, e.world_size, e.local_rank) == (1, 2, 1)


# -- concurrent jobs and steps do not meet -----------------------------------------------------


def test_two_concurrent_steps_of_one_job_use_different_ports() -> None:
    ports = {
        environment({**SRUN_N2_RANK_1, "SLURM_STEP_ID": str(step)}).master_port
        for step in range(50)
    }
    assert len(ports) == 50


def test_every_rank_of_a_step_agrees_on_its_port() -> None:
    step = {**SRUN_N2_RANK_1, "SLURM_STEP_ID": "3"}
    assert environment(_rank(step, 0)).master_port == environment(_rank(step, 1)).master_port


def test_two_mpirun_jobs_on_one_host_use_different_ports() -> None:
    one = environment({**MPIRUN_IN_A_ONE_TASK_STEP, "MASTER_ADDR": "127.0.0.1"})
    other = environment(
        {
            **MPIRUN_IN_A_ONE_TASK_STEP,
            "MASTER_ADDR": "127.0.0.1",
            "OMPI_MCA_ess_base_jobid": "3050962945",
        }
    )
    assert one.master_port != other.master_port


# -- GPUs: every rank of the node refuses, not only the one without a GPU ------------------


def test_every_rank_of_a_node_refuses_local_ranks_beyond_the_visible_gpus() -> None:
    # CUDA_VISIBLE_DEVICES=0 srun -n2 python train.py: rank 1 has no cuda:1, and rank 0 must
    # not wait for it in the rendezvous.
    for rank in (0, 1):
        started = time.monotonic()
        with pytest.raises(DistributedError, match=r"cuda:1 \(local rank 1's\)") as info:
            environment({**_rank(SRUN_N2_RANK_1, rank), "CUDA_VISIBLE_DEVICES": "0"})
        assert time.monotonic() - started < 5
        assert "CUDA_VISIBLE_DEVICES=0" in str(info.value)


def test_tasks_bound_to_their_own_gpus_each_use_their_cuda_0() -> None:
    env = {**SRUN_N2_RANK_1, "SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "1"}
    for rank in (0, 1):
        assert environment(_rank(env, rank)).cuda_index == 0


# -- srun -m arbitrary ----------------------------------------------------------------------


def test_arbitrary_placement_is_refused_instead_of_a_rendezvous_on_the_wrong_host() -> None:
    # srun -n2 -m arbitrary -w hostfile (n2, n1): rank 0 runs on n2, the list's first is n1.
    env = {
        "SLURM_DISTRIBUTION": "arbitrary",
        "SLURM_JOB_ID": "9",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_TASKS_PER_NODE": "1(x2)",
    }
    with pytest.raises(DistributedError, match="SLURM_DISTRIBUTION=arbitrary") as info:
        environment(env)
    assert "MASTER_ADDR" in (info.value.hint or "")
    assert environment({**env, "MASTER_ADDR": "n2"}).master_addr == "n2"


# -- gpukit run --ddp under srun ------------------------------------------------------------


def test_torchrun_args_refuse_several_tasks_on_one_node() -> None:
    # srun -N1 -n2 gpukit run --ddp: each task would start its own standalone torchrun.
    with pytest.raises(DistributedError, match="2 tasks on this node") as info:
        dist.torchrun_args(1, SRUN_N2_RANK_1)
    assert "the node's 1 process itself" in str(info.value)


def test_torchrun_args_leave_the_node_rank_to_the_c10d_rendezvous() -> None:
    env = {
        **SRUN_N2_RANK_1,
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_TASKS_PER_NODE": "1(x2)",
    }
    args = dist.torchrun_args(2, env)
    assert "--rdzv-backend=c10d" in args
    assert not [a for a in args if a.startswith(("--node-rank", "--node_rank"))]


@pytest.mark.parametrize(
    ("job", "says"),
    [
        (SRUN_N2_RANK_1, "srun --ntasks-per-node=1"),  # srun -N1 -n2 gpukit run --ddp
        (  # the batch script of a two-node job
            {
                "SLURM_JOB_ID": "5",
                "SLURM_JOB_NUM_NODES": "2",
                "SLURM_NNODES": "2",
                "SLURM_JOB_NODELIST": "n[1-2]",
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": "0",
                "SLURM_TASKS_PER_NODE": "1(x2)",
            },
            "srun --ntasks-per-node=1",
        ),
    ],
)
def test_gpukit_run_ddp_refuses_a_job_it_cannot_start_as_a_usage_error(
    run_cli: CliRunner, machines_dir: object, job: dict[str, str], says: str
) -> None:
    env: dict[str, str | None] = {"GPUKIT_FAKE_NVML": f"{machines_dir}/no-driver.json", **job}
    done = run_cli("run", "--ddp", "--cpu-ok", "-n", "1", "--", "python", "train.py", env=env)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
    assert "Traceback" not in done.stderr
