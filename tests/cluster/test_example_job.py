"""``examples/slurm_train.sbatch``, submitted as a user would, runs under a real one-node Slurm.

The job's ``srun gpukit run --ddp`` starts two CPU processes here (``GPUKIT_RUN_OPTIONS``);
the loop's preemption through this script's ``--signal=USR1@90`` and ``--requeue`` is what
``test_slurm_preemption.py`` runs with the same lines.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpukit.train import saves
from tests.cluster.conftest import ROOT, assert_ok, job_env
from tests.cluster.slurm import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SCRIPT = ROOT / "examples" / "slurm_train.sbatch"


def test_the_example_batch_script_trains_under_slurm(one_node: Cluster, tmp_path: Path) -> None:
    output = tmp_path / "job.out"
    submitted = one_node.run(
        "sbatch", "--parsable", f"--chdir={ROOT}", f"--output={output}", "-n1", "-c2",
        str(SCRIPT), "--small", "--out", str(tmp_path / "state"),
        env=job_env(GPUKIT_RUN_OPTIONS="--cpu-ok -n 2"),
    )  # fmt: skip
    assert_ok(submitted)
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240
    while one_node.job_state(job) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.monotonic() < deadline, "the job did not end within 240 s"
        time.sleep(0.5)
    log = output.read_text(errors="replace")[-3000:] if output.exists() else ""
    assert one_node.job_state(job) == "COMPLETED", log
    assert "done: 48 steps" in log
    save, _ = saves.newest(tmp_path / "state")
    assert save is not None
    assert save.step == 48
