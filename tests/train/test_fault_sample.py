"""A sample of the fault matrix (``benchmarks/bench_faults.py``): faults injected into a
two-process run, each run resumed to its end, the invariants of a crash-consistent training
state asserted.

About 30 faults of the cheaper kinds (no launch through ``gpukit run``): damaged saves (a byte
flipped, a file cut short or removed), kill -9 of a rank at a moment of a step, at a point of a
save or of a resume, of a DataLoader worker, stop signals to one rank, and (as root) a full disk
and a read-only folder. Timing varies from run to run; nothing asserted depends on it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# Its workers train on the CPU with gloo, on a GPU machine too.
pytestmark = [pytest.mark.slow, pytest.mark.cpu_workers]

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = 30
# The cheaper kinds only: a launch through gpukit run starts four Pythons.
MIX = {
    "flip": 0.3,
    "truncate": 0.15,
    "remove": 0.15,
    "kill_step": 0.07,
    "kill_save": 0.12,
    "kill_resume": 0.04,
    "kill_worker": 0.04,
    "signal": 0.06,
    "disk_full": 0.04,
    "read_only": 0.03,
}


def _bench() -> ModuleType:
    """``benchmarks/bench_faults.py``, imported by its path (benchmarks/ is no package)."""
    name = "bench_faults"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "bench_faults.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sample, run once: its records and figures, and whether saves carry digests."""
    bench = _bench()
    faults = bench.plan_faults(SAMPLE, 7, MIX, can_mount=bench.can_mount())
    work = tmp_path_factory.mktemp("faults")
    # A process of this session's own, started before the matrix (as a cluster fixture's
    # daemons are): not the faults' to count or to kill.
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        records, summary = bench.run_matrix(faults, work)
        bystander_alive = bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
    return {
        "records": records,
        "summary": summary,
        "digests": _saves_have_digests(work),
        "bystander_alive": bystander_alive,
    }


def _saves_have_digests(work: Path) -> bool:
    """Whether this gpukit writes each file's digest into a save's marker (and so can tell a
    byte changed in place from the original)."""
    marker = next((work / "reference" / "run").glob("step-*/COMPLETE.json"))
    return "digests" in json.loads(marker.read_text())


def _said(records: list[Any], check: str) -> str:
    return "; ".join(f"fault {r.index} {r.kind} {r.params}: {r.notes}" for r in records) or check


def test_every_fault_of_the_sample_was_injected(matrix: dict[str, Any]) -> None:
    assert matrix["summary"]["faults"] == SAMPLE


def test_no_resumed_run_ends_with_other_weights_than_the_uninterrupted_run(
    matrix: dict[str, Any],
) -> None:
    diverged = [r for r in matrix["records"] if r.outcome == "diverged"]
    if diverged and not matrix["digests"]:
        pytest.xfail("saves without digests: a byte flipped in place may load unseen")
    assert not diverged, _said(diverged, "divergences")


def test_every_run_resumed_on_two_processes_ends_bitwise_equal(matrix: dict[str, Any]) -> None:
    same = [r for r in matrix["records"] if r.resume_world == 2 and r.outcome != "equal"]
    if same and not matrix["digests"]:
        pytest.xfail("saves without digests: a byte flipped in place may load unseen")
    assert not same, _said(same, "unequal")


def test_no_run_hangs(matrix: dict[str, Any]) -> None:
    hung = [r for r in matrix["records"] if r.outcome == "hang"]
    assert not hung, _said(hung, "hangs")


def test_no_resume_loads_a_torn_or_damaged_save(matrix: dict[str, Any]) -> None:
    loaded = [r for r in matrix["records"] if r.damaged_load]
    if loaded and not matrix["digests"] and all(r.kind == "flip" for r in loaded):
        pytest.xfail("saves without digests: a byte flipped in place may load unseen")
    assert not loaded, _said(loaded, "damaged loads")


def test_no_save_is_lost_beyond_the_last_complete_one(matrix: dict[str, Any]) -> None:
    lost = [r for r in matrix["records"] if r.lost]
    assert not lost, _said(lost, "lost saves")


def test_no_process_is_left_behind(matrix: dict[str, Any]) -> None:
    left = [r for r in matrix["records"] if r.left_behind]
    assert not left, _said(left, "leftovers")


def test_every_run_asked_to_stop_stops_without_an_error_of_its_own(matrix: dict[str, Any]) -> None:
    unclean = [r for r in matrix["records"] if _bench()._unclean_stop(r)]
    assert not unclean, _said(unclean, "unclean stops")


def test_processes_started_before_the_matrix_are_neither_counted_nor_killed(
    matrix: dict[str, Any],
) -> None:
    assert matrix["bystander_alive"]
