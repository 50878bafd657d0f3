"""Two Slurm "nodes" on this machine, each running `gpukit run --ddp --cpu-ok -n 2`, as srun would.

Each node gets the variables srun sets for one task per node; `gpukit run --ddp` turns them into
torchrun options (node count, node rank, a c10d rendezvous on the first node at a port derived
from the job id), and the four workers train together on gloo. They must end with the weights
of one process trained on the same global batches.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpukit.distributed.ports import job_port
from tests.distributed.test_distributed_multiprocess import (
    LAUNCH_VARS,
    SCRIPTS,
    _assert_all_gone,
    _env,
    _pids,
)
from tests.helpers import MACHINES

pytestmark = pytest.mark.slow


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _job_with_a_free_port(start: int) -> str:
    """A Slurm job id whose derived rendezvous port is free right now."""
    return next(str(job) for job in range(start, start + 500) if _port_is_free(job_port(str(job))))


def _node_env(node: int, job: str) -> dict[str, str]:
    env = {k: v for k, v in _env().items() if k not in (*LAUNCH_VARS, "MASTER_ADDR")}
    env.update(
        GPUKIT_FAKE_NVML=str(MACHINES / "no-driver.json"),  # the same on a GPU machine
        SLURM_JOB_ID=job,
        SLURM_STEP_ID="0",
        SLURM_PROCID=str(node),
        SLURM_NTASKS="2",
        SLURM_LOCALID="0",
        SLURM_NODEID=str(node),
        SLURM_NNODES="2",
        SLURM_TASKS_PER_NODE="1(x2)",
        SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1",
    )
    return env


def _run_nodes(job: str, out: Path) -> list[tuple[int, str]]:
    command = [
        sys.executable, "-m", "gpukit", "run", "--ddp", "--cpu-ok", "-n", "2", "--",
        sys.executable, str(SCRIPTS / "torchrun_train.py"), str(out),
    ]  # fmt: skip
    nodes = [
        subprocess.Popen(
            command,
            env=_node_env(node, job),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: a failure reaps every worker
        )
        for node in (0, 1)
    ]
    try:
        return [(node.wait(timeout=300), node.communicate()[1]) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(timeout=10)


def test_two_srun_nodes_running_gpukit_run_ddp_train_like_one_process(tmp_path: Path) -> None:
    single_dir = tmp_path / "single"
    single_dir.mkdir()
    env = {k: v for k, v in _env().items() if k not in LAUNCH_VARS}
    subprocess.run(
        [sys.executable, str(SCRIPTS / "torchrun_train.py"), str(single_dir)],
        env=env,
        check=True,
        timeout=120,
    )
    single = json.loads((single_dir / "rank0.json").read_text())

    for attempt in range(3):  # a derived port taken between the check and the bind: retry
        out = tmp_path / f"nodes{attempt}"
        out.mkdir()
        results = _run_nodes(_job_with_a_free_port(4242 + 1000 * attempt), out)
        if all(code == 0 for code, _ in results) or "address already in use" not in str(results):
            break
    assert [code for code, _ in results] == [0, 0], [err[-3000:] for _, err in results]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(r["rank"], r["world_size"], r["backend"]) for r in ranks] == [
        (r, 4, "gloo") for r in range(4)
    ]
    for rank in ranks:
        assert rank["weights"] == pytest.approx(single["weights"], rel=0, abs=1e-12)
    _assert_all_gone(_pids(out))
