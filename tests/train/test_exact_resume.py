"""A run interrupted and resumed ends with the weights of the run never interrupted.

Bitwise on the same number of processes (dropout, per-rank NumPy and Python draws, shuffle and
two loader workers included); within 1e-12 in float64 when resumed on another number of
processes. One launch of 2 processes and one of 3 run every multi-process case.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpukit.distributed import launch
from gpukit.train import saves
from tests.train import workload

# Its workers train on the CPU with gloo, on a GPU machine too.
pytestmark = [pytest.mark.slow, pytest.mark.cpu_workers]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "run_and_report.py"
# Interruptions chosen at random once (seeded, so that a failure can be replayed): before,
# on and after a save step, twice in one epoch, at an epoch's last step.
STOPS_ONE = sorted(random.Random(29).sample(range(1, workload.STEPS), 4))
STOPS_TWO = [4, 10, 12, 23]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The cases of a 2-process group, launched once."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = tmp_path_factory.mktemp("two")
    results = launch(workload.cases, 2, str(root), STOPS_TWO, 17)
    return {"root": root, "rank0": results[0], "rank1": results[1]}


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same cases in this process, alone."""
    root = tmp_path_factory.mktemp("one")
    found = workload.cases(str(root), STOPS_ONE, 14)
    return {"root": root, **found}


def test_one_process_interrupted_at_random_steps_ends_bitwise_as_the_whole_run(
    one: dict[str, Any],
) -> None:
    assert one["cut"] == one["whole"]


def test_two_processes_interrupted_at_random_steps_end_bitwise_as_the_whole_run(
    two: dict[str, Any],
) -> None:
    assert two["rank0"]["cut"] == two["rank0"]["whole"]
    assert two["rank1"]["cut"] == two["rank0"]["whole"]


def test_a_resume_that_forgets_the_random_streams_does_not_end_as_the_whole_run(
    one: dict[str, Any], tmp_path: Path
) -> None:
    # What the two tests above would see if the streams were not restored: the check is real.
    cut = workload.segments(str(tmp_path), STOPS_ONE[:2], restore_rng=False)
    assert cut != one["whole"]


def test_two_processes_resumed_on_one_end_within_1e_12_of_the_whole_run(
    one: dict[str, Any], two: dict[str, Any]
) -> None:
    finished = workload.finish(str(two["root"] / "world2" / "handoff"))
    assert finished is not None
    assert _farthest(finished, one["plain"]) <= 1e-12
    assert _farthest(finished, two["rank0"]["plain"]) <= 1e-12


def test_one_process_resumed_on_three_ends_within_1e_12_of_the_whole_run(
    one: dict[str, Any],
) -> None:
    results = launch(workload.finish, 3, str(one["root"] / "world1" / "handoff"))
    for finished in results:
        assert finished is not None
        assert _farthest(finished, one["plain"]) <= 1e-12


def test_runs_accumulating_micro_batches_interrupted_mid_step_end_bitwise_as_the_whole_run(
    one: dict[str, Any], two: dict[str, Any]
) -> None:
    # Each stop dies between the micro-batches of a step: the resume takes the last save, made
    # after an optimizer step, and does those micro-batches again.
    assert one["accumulated_cut"] == one["accumulated"]
    assert two["rank0"]["accumulated_cut"] == two["rank0"]["accumulated"]
    assert two["rank1"]["accumulated_cut"] == two["rank0"]["accumulated"]


def test_an_accumulating_run_of_two_processes_resumed_on_one_ends_within_1e_12(
    one: dict[str, Any], two: dict[str, Any]
) -> None:
    folder = str(two["root"] / "world2" / "acc-handoff")
    finished = workload.finish(folder, **workload.ACCUMULATED)
    assert finished is not None
    assert _farthest(finished, one["accumulated_plain"]) <= 1e-12
    assert _farthest(two["rank0"]["accumulated_plain"], one["accumulated_plain"]) <= 1e-12


def _farthest(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# --- kill -9 ---------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _start(folder: Path, rank: int | None = None, world: int = 1, store: str = "") -> Any:
    args = [] if rank is None else [str(rank), str(world), store]
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(folder), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )


def _saves_reported(process: Any) -> Iterator[int]:
    for line in process.stdout:
        if line.startswith("saved "):
            yield int(line.split()[1])


def _kill_after(process: Any, step: int) -> None:
    """SIGKILL ``process`` as soon as it reports the save of ``step`` (its write then runs)."""
    for saved in _saves_reported(process):
        if saved >= step:
            break
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)


def _check_loadable(folder: Path) -> int:
    info, _ = saves.newest(folder / "run")
    assert info is not None, "the kill left no complete save"
    for name in info.files:
        saves.load_part(info.path, name)
    return info.step


def test_a_process_killed_while_it_saves_resumes_from_a_complete_save_bitwise(
    one: dict[str, Any], tmp_path: Path
) -> None:
    for kill_at in (3, 11, 20):  # every step saves asynchronously: each kill lands in a save
        _kill_after(_start(tmp_path), kill_at)
        assert _check_loadable(tmp_path) >= kill_at - 1
    last = _start(tmp_path)
    _, err = last.communicate(timeout=300)
    assert last.returncode == 0, err
    final = torch.load(tmp_path / "final-0.pt", weights_only=True).tolist()
    assert final == one["whole"]


def test_a_rank_killed_while_it_saves_leaves_its_job_resumable_bitwise(
    two: dict[str, Any], tmp_path: Path
) -> None:
    for attempt, kill_at in enumerate((6, 19)):
        store = str(tmp_path / f"store-{attempt}")
        ranks = [_start(tmp_path, rank, 2, store) for rank in range(2)]
        _kill_after(ranks[1], kill_at)  # kill -9 of one rank...
        ranks[0].send_signal(signal.SIGKILL)  # ...then of the rest, as its launcher does
        ranks[0].communicate(timeout=60)
        assert _check_loadable(tmp_path) >= kill_at - 1
    store = str(tmp_path / "store-last")
    ranks = [_start(tmp_path, rank, 2, store) for rank in range(2)]
    for process in ranks:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
    for rank in range(2):
        final = torch.load(tmp_path / f"final-{rank}.pt", weights_only=True).tolist()
        assert final == two["rank0"]["whole"]
