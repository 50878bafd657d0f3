"""Exact gradient accumulation: N processes x K micro-batches end with one process's weights.

One subprocess runs the whole table (``scripts/accumulate_session.py``): the one-process
references in plain torch, gpukit's loop in this process's group of one, then in launched
groups of 2 and 3 processes, every case inside the same launch. Each test reads one row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Its workers train on the CPU with gloo, on a GPU machine too.
pytestmark = [pytest.mark.slow, pytest.mark.cpu_workers]

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import accumulate_workloads as work  # noqa: E402

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # A file, not stdout: a worker's late warning can land in the middle of a long line.
    out = tmp_path_factory.mktemp("table") / "table.json"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(SCRIPTS)])
    env["MASTER_ADDR"] = "127.0.0.1"
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "accumulate_session.py"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=480,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.parametrize("world", ["1", "2", "3"])
@pytest.mark.parametrize(
    "case",
    work.cases(),
    ids=lambda c: f"{c[0]}-samples-K{c[1]}-{c[2]}" + ("-tokens" if c[3] else ""),
)
def test_every_process_ends_with_the_weights_of_one_process_taking_the_whole_global_batch(
    table: dict[str, Any], world: str, case: tuple[int, int, str, bool]
) -> None:
    # 97 samples in global batches of 36 leave a last window of 25 (with K=3: micro-batches of
    # 12, 12 and 1, the 1 on rank 0 and empty batches on the others); 101 leave 29. Dividing
    # each micro-batch's loss by K, or weighing the all-reduce by the last micro-batch's
    # share, moves the weights by 1e-4 to 1e-2; the order of the sums alone by ~1e-16.
    expected = table["references"][repr(case)]
    ranks = table["worlds"][world]
    assert len(ranks) == int(world)
    for weights in ranks:
        assert weights[repr(case)] == pytest.approx(expected, rel=0, abs=1e-12)
