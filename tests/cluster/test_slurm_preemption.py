"""A real one-node Slurm preempts a job mid-epoch: it saves, is requeued, resumes, and ends with
the weights of the run that was never interrupted.

The job runs ``srun gpukit run --ddp``, so Slurm's signal takes the whole way a real job's
does: srun to gpukit, gpukit to torchrun, torchrun to each worker.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import SCRIPTS, assert_ok, assert_one_training, job_env
from tests.cluster.slurm import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PREEMPT = SCRIPTS / "preempt.py"


def _until(what: str, check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f}s"
        time.sleep(0.5)


def test_a_job_signalled_mid_epoch_saves_is_requeued_resumes_and_trains_like_one_process(
    one_node: Cluster, single_weights: list[float], tmp_path: Path
) -> None:
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --requeue\n"
        "#SBATCH --signal=USR1@90\n"
        f"srun --ntasks-per-node=1 {sys.executable} -m gpukit run --ddp --cpu-ok -n 2 -- "
        f"python {PREEMPT} {tmp_path}\n"
    )
    output = tmp_path / "job.out"
    submitted = one_node.run(
        "sbatch", "--parsable", "--open-mode=append", "-n1", "-c2", f"--output={output}",
        str(script),
        env=job_env(),
    )  # fmt: skip
    assert_ok(submitted)
    job = submitted.stdout.strip().split(";")[0]
    _until("the first run's arrival mid-epoch", (tmp_path / "waiting").exists, 180)
    # What --signal=USR1@90 sends 90 s before the time limit, sent now.
    assert_ok(one_node.run("scancel", "--signal=USR1", job))
    _until("the save", (tmp_path / "state.pt").exists, 120)
    # Requeued by the job itself (scontrol requeue): Slurm holds a requeued job back for a
    # while (its begin time); let it start at once.
    _until("the requeue", lambda: one_node.job_state(job) == "PENDING", 120)
    assert_ok(one_node.run("scontrol", "update", f"JobId={job}", "StartTime=now"))
    _until(
        "the requeued job's end",
        lambda: one_node.job_state(job) in ("COMPLETED", "FAILED", "CANCELLED"),
        240,
    )
    log = output.read_text(errors="replace")[-3000:]
    assert one_node.job_state(job) == "COMPLETED", log
    stopped = [json.loads((tmp_path / f"stopped-rank{r}.json").read_text()) for r in (0, 1)]
    assert stopped[0] == stopped[1], "the ranks stopped at different steps"
    assert stopped[0]["at"] == [0, 4]  # the step the signal came at: mid-epoch
    results = assert_one_training(tmp_path, 2, single_weights, source="torchrun")
    assert {tuple(r["resumed_at"]) for r in results} == {(0, 5)}
