"""Exact mode: bitwise the same weights and optimizer state on 1, 2 and 4 processes.

Each case trains two epochs over 70 samples in steps of 16 (a short last step of 6: its
micro-batches 4 + 2, the rest empty), shuffled, with dropout and LayerNorm, and is compared
with ``torch.equal``, weight by weight and moment by moment, with the same case run in this
process alone. One launch of 2 processes and one of 4 run every case.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gpukit.distributed import launch
from gpukit.train import saves

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import same_bits as work

pytestmark = [pytest.mark.slow, pytest.mark.cpu_workers]

CASES = {
    "float32-adamw-dropout-layernorm": work.Case(),
    "float64-sgd-momentum-token-counts": work.Case(
        dtype="float64", optimizer="sgd-momentum", counts=True
    ),
    "bf16-mixed-adamw-dropout": work.Case(precision="bf16-mixed"),
    "float32-micro-2-unshuffled-no-norm": work.Case(micro=2, shuffle=False, norm="none"),
    "fsdp2-float32-adamw-dropout": work.Case(shard=True),
    "fsdp2-bf16-mixed-sgd-momentum": work.Case(
        shard=True, precision="bf16-mixed", optimizer="sgd-momentum"
    ),
}
MASKED = work.Case(epochs=1)


@pytest.fixture(scope="module")
def worlds() -> dict[int, list[dict[str, Any]]]:
    """What each rank of 2 and of 4 processes returned, launched once each."""
    cases = list(CASES.values())
    return {n: launch(work.everything, n, cases, MASKED) for n in (2, 4)}


@pytest.fixture(scope="module")
def alone() -> dict[str, Any]:
    """The same work in this process, alone."""
    return work.everything(list(CASES.values()), MASKED)


def _equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(
        a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_of_n_processes_ends_bitwise_with_one_process(
    worlds: dict[int, list[dict[str, Any]]], alone: dict[str, Any], n: int, name: str
) -> None:
    index = list(CASES).index(name)
    want = alone["runs"][index]
    for rank, result in enumerate(worlds[n]):
        got = result["runs"][index]
        assert _equal(got["weights"], want["weights"]), f"rank {rank} of {n}: weights differ"
        assert _equal(got["optimizer"], want["optimizer"]), f"rank {rank} of {n}: optimizer"
        assert got["optimizer"], "the optimizer kept no state to compare"


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp2_in_exact_mode_ends_with_the_weights_of_the_unsharded_exact_mode(
    worlds: dict[int, list[dict[str, Any]]], n: int
) -> None:
    sharded = list(CASES).index("fsdp2-float32-adamw-dropout")
    plain = list(CASES).index("float32-adamw-dropout-layernorm")
    for result in worlds[n]:
        got, want = result["runs"][sharded], result["runs"][plain]
        assert _equal(got["weights"], want["weights"])
        assert _equal(got["optimizer"], want["optimizer"])


@pytest.mark.parametrize("n", [2, 4])
def test_dropout_masks_follow_the_micro_batch_not_the_process(
    worlds: dict[int, list[dict[str, Any]]], alone: dict[str, Any], n: int
) -> None:
    # Micro-batch j of a step is computed by rank j // K: gathered in that order, the ranks'
    # masks are one process's masks, mask for mask.
    k = (MASKED.global_batch // MASKED.micro) // n
    per_rank = [result["masks"] for result in worlds[n]]
    steps = len(per_rank[0]) // k
    gathered = [
        mask
        for step in range(steps)
        for masks in per_rank
        for mask in masks[step * k : step * k + k]
    ]
    one = alone["masks"]
    assert len(gathered) == len(one)
    for j, (got, want) in enumerate(zip(gathered, one, strict=True)):
        assert torch.equal(got, want), f"micro-batch {j}: another mask on {n} processes"


def test_no_two_micro_batches_of_a_step_share_a_dropout_mask(alone: dict[str, Any]) -> None:
    masks = [m for m in alone["masks"] if m.shape[0] == MASKED.micro]
    per_step = MASKED.global_batch // MASKED.micro
    for start in range(0, len(masks) - per_step + 1, per_step):
        step = masks[start : start + per_step]
        for i in range(per_step):
            for j in range(i + 1, per_step):
                assert not torch.equal(step[i], step[j]), f"micro-batches {i} and {j} share"


def test_outside_exact_mode_the_ranks_draw_their_own_masks(
    worlds: dict[int, list[dict[str, Any]]],
) -> None:
    # One seed per process made every rank draw rank 0's masks: on 2 processes samples 8-15 of
    # each step reused the masks of samples 0-7.
    first, second = (result["normal_masks"] for result in worlds[2])
    same = [torch.equal(a, b) for a, b in zip(first, second, strict=True) if a.shape == b.shape]
    assert same
    assert not any(same)


RESUME = work.Case(epochs=2)


@pytest.mark.parametrize(
    ("sizes", "shard"),
    [((2, 4, 1), False), ((1, 2, 4), False), ((4, 2, 4), True)],
    ids=["2-then-4-then-1", "1-2-4", "fsdp2-4-2-4"],
)
def test_a_run_resumed_on_other_numbers_of_processes_ends_bitwise_as_the_whole_run(
    tmp_path: Path, sizes: tuple[int, int, int], shard: bool
) -> None:
    # 10 steps in all (5 an epoch); saves every 3 steps. Each start but the last dies at a
    # step after a save, losing the steps since: the next start redoes them on another number
    # of processes.
    folder = str(tmp_path / "saves")
    case = RESUME.but(shard=shard)
    whole = work.run(case)
    for n, stop in zip(sizes, (4, 8, None), strict=True):
        results = _segment_on(n, case, folder, stop)
    _assert_ended_as(results, whole)


def _segment_on(n: int, case: work.Case, folder: str, stop: int | None) -> list[Any]:
    """One start of ``case`` on ``n`` processes (this one alone for 1): each rank's result."""
    if n == 1:
        return [work.segment(case, folder, stop)]
    return launch(work.segment, n, case, folder, stop)


def _assert_ended_as(results: list[Any], whole: dict[str, list[torch.Tensor]]) -> None:
    for result in results:
        assert result is not None
        assert _equal(result["weights"], whole["weights"])
        assert _equal(result["optimizer"], whole["optimizer"])


def test_clipping_a_sharded_model_in_exact_mode_is_refused_before_the_backward(
    worlds: dict[int, list[dict[str, Any]]],
) -> None:
    for result in worlds[4]:
        assert "clip_grad_norm= in exact mode with a sharded model" in result["clipping"]
        assert result["clipping"].endswith("unchanged=True")


@pytest.mark.parametrize(("stopped_on", "resumed_on"), [(2, 1), (4, 2)])
def test_a_run_preempted_on_n_processes_and_resumed_on_m_ends_bitwise_as_the_whole_run(
    tmp_path: Path, stopped_on: int, resumed_on: int
) -> None:
    # SIGUSR1 to rank 0 after step 3: every rank stops at one step boundary, saves, exits 75.
    folder = str(tmp_path / "saves")
    whole = work.run(RESUME)
    stops = launch(work.preempted, stopped_on, RESUME, folder, 3)
    assert {stop["code"] for stop in stops} == {75}
    assert len({stop["step"] for stop in stops}) == 1
    _assert_ended_as(_segment_on(resumed_on, RESUME, folder, None), whole)


def test_a_job_killed_with_sigkill_while_it_saves_resumes_on_another_number_bitwise(
    tmp_path: Path,
) -> None:
    # Two ranks save every step; when rank 1 reports the save of step 4 (its files are being
    # written), both are killed with SIGKILL. One process resumes from the newest complete
    # save and ends with the weights of the run never interrupted.
    script = Path(__file__).resolve().parent / "scripts" / "same_bits_killed.py"
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root / "src"), str(script.parent)]),
        "OMP_NUM_THREADS": "1",
    }
    folder = tmp_path / "saves"
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(folder), str(rank), "2", str(tmp_path / "store")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    try:
        assert ranks[1].stdout is not None
        for line in ranks[1].stdout:
            if line.startswith("saved ") and int(line.split()[1]) >= 4:
                break
    finally:
        for process in ranks:
            process.send_signal(signal.SIGKILL)
            process.communicate(timeout=60)
    info, _ = saves.newest(folder)
    assert info is not None
    assert info.step >= 3
    _assert_ended_as([work.segment(RESUME, str(folder), None)], work.run(RESUME))
