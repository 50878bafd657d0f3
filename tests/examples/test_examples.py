"""Each file of ``examples/`` runs as its docstring says, on small sizes (``--small``): an
example that stops working fails here, not in a user's hands.

The Slurm batch script runs under a real Slurm in ``tests/cluster/test_example_job.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpukit.train import PREEMPTED_EXIT_CODE, saves

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

pytestmark = [pytest.mark.slow, pytest.mark.cpu_workers]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        list(args), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_the_loop_trains_saves_each_epoch_and_a_second_run_resumes(tmp_path: Path) -> None:
    out = tmp_path / "loop"
    first = _run(sys.executable, "examples/train_loop.py", "--small", "--out", str(out))
    assert "done: 48 steps" in first.stdout  # 1,000 samples in steps of 64, three epochs
    assert saves.newest(out)[0] is not None
    again = _run(sys.executable, "examples/train_loop.py", "--small", "--out", str(out))
    assert "resumed from step-000000048" in again.stdout
    assert "done: 48 steps" in again.stdout


def test_the_loop_stopped_by_a_signal_saves_exits_75_and_resumes_there(tmp_path: Path) -> None:
    out = tmp_path / "loop"
    proc = subprocess.Popen(
        [sys.executable, "examples/train_loop.py", "--small", "--out", str(out)],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the first progress line: the loop is stepping
        assert "step 10" in line, line
        proc.send_signal(signal.SIGUSR1)  # what Slurm's --signal=USR1@90 sends
        rest, errors = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == PREEMPTED_EXIT_CODE, errors[-3000:]
    assert "done" not in rest
    save, _ = saves.newest(out)
    assert save is not None
    assert 0 < save.step < 48  # saved where it stopped, mid-run
    resumed = _run(sys.executable, "examples/train_loop.py", "--small", "--out", str(out))
    assert f"resumed from {save.path.name}" in resumed.stdout
    assert "done: 48 steps" in resumed.stdout


def test_the_transformers_example_trains_exports_and_reopens_with_from_pretrained(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (the hf extra)")
    out = tmp_path / "gpt2"
    done = _run(sys.executable, "examples/train_transformers.py", "--small", "--out", str(out))
    assert f"exported to {out / 'hf'}; from_pretrained has" in done.stdout
    assert (out / "hf" / "config.json").is_file()


def test_the_transformers_example_runs_sharded_on_two_processes(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (the hf extra)")
    out = tmp_path / "gpt2"
    done = _run(
        sys.executable, "-m", "gpukit", "run", "--ddp", "--cpu-ok", "-n", "2", "--",
        sys.executable, "examples/train_transformers.py", "--small", "--shard", "--out", str(out),
    )  # fmt: skip
    assert done.stdout.count("exported to") == 1, done.stdout  # rank 0 alone reopens it
    assert (out / "hf" / "model.safetensors.index.json").is_file()
