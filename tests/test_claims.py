"""gk.claim, the lock folder, and the line of waiters: what other gpukit users can rely on."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gpukit.errors import ClaimError, NoGpuAvailableError, WaitTimeoutError
from gpukit.gpus.claims import current_claims, holder_of, lock_dir
from gpukit.gpus.inventory import GpuProcess, Inventory, inventory
from gpukit.gpus.select import Criteria, claim
from gpukit.gpus.waiting import Ticket, wait_and_claim

ROOT = Path(__file__).resolve().parent.parent
L4 = Path(__file__).parent / "fixtures" / "machines" / "server-4xL4-idle.json"
UUID_A = "GPU-00000000-0000-0000-0000-00000000000a"
UUID_B = "GPU-00000000-0000-0000-0000-00000000000b"


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(L4))
    return folder


def _holder_process(uuid: str) -> subprocess.Popen[str]:
    """Another process that claims ``uuid`` and then sleeps, printing 'held' once it holds it."""
    code = (
        "import sys, time; from gpukit.gpus.claims import claim; "
        f"c = claim([{uuid!r}], command='other job'); print('held', flush=True); time.sleep(60)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_claim_records_who_holds_it_for_gpukit_list() -> None:
    with claim([UUID_A], command="python train.py"):
        holder = current_claims()[UUID_A]
    assert (holder.pid, holder.command) == (os.getpid(), "python train.py")
    assert holder.user
    assert holder.since
    assert holder.since <= time.time()


def test_a_claimed_gpu_cannot_be_claimed_again_until_released() -> None:
    first = claim([UUID_A])
    with pytest.raises(ClaimError, match=f"{UUID_A} by"):
        claim([UUID_A])
    first.release()
    assert claim([UUID_A]).held


def test_claims_are_all_or_nothing() -> None:
    with claim([UUID_B]), pytest.raises(ClaimError):
        claim([UUID_A, UUID_B])
    assert UUID_A not in current_claims()
    assert claim([UUID_A]).held


def test_released_claims_are_not_listed() -> None:
    held = claim([UUID_A, UUID_B])
    assert set(current_claims()) == {UUID_A, UUID_B}
    held.release()
    assert current_claims() == {}


def test_a_claim_held_by_another_process_names_it_in_the_error() -> None:
    other = _holder_process(UUID_A)
    try:
        with pytest.raises(ClaimError, match=f"pid {other.pid}: other job"):
            claim([UUID_A])
    finally:
        other.kill()
        other.wait()


def test_the_claim_of_a_killed_process_is_gone_at_once() -> None:
    other = _holder_process(UUID_A)
    assert current_claims()[UUID_A].pid == other.pid
    other.send_signal(signal.SIGKILL)
    other.wait()
    assert current_claims() == {}
    assert claim([UUID_A]).held


def test_a_record_left_without_a_lock_is_not_a_claim(locks: Path) -> None:
    locks.mkdir(parents=True)
    record = {"user": "ghost", "pid": 1, "host": "h", "command": "x", "since": 0}
    (locks / f"{UUID_A}.lock").write_text(json.dumps(record))
    assert holder_of(locks / f"{UUID_A}.lock") is None
    assert current_claims() == {}


def test_the_lock_folder_and_files_are_writable_by_every_user(locks: Path) -> None:
    claim([UUID_A]).release()
    folder_mode = stat.S_IMODE(lock_dir().stat().st_mode)
    assert folder_mode == 0o1777  # sticky: users cannot delete each other's files
    assert stat.S_IMODE((locks / f"{UUID_A}.lock").stat().st_mode) == 0o666


def test_a_child_process_does_not_inherit_the_claim() -> None:
    with claim([UUID_A]) as held:
        child = subprocess.Popen(["sleep", "30"], close_fds=False)
        try:
            held.release()
            assert current_claims() == {}  # the child lives on, the claim does not
        finally:
            child.kill()
            child.wait()


def test_claim_refuses_things_that_are_not_gpus() -> None:
    with pytest.raises(ValueError, match="Cannot claim"):
        claim([3])  # type: ignore[list-item]


def test_waiters_are_counted_in_arrival_order_and_a_dead_one_is_skipped() -> None:
    first = Ticket()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    code = "from gpukit.gpus.waiting import Ticket; t = Ticket(); print('in', flush=True); input()"
    middle = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert middle.stdout is not None
    assert middle.stdout.readline().strip() == "in"
    last = Ticket()
    assert (first.ahead(), last.ahead()) == (0, 2)
    middle.kill()
    middle.wait()
    assert last.ahead() == 1
    first.close()
    assert last.ahead() == 0
    last.close()


def test_waiting_gives_up_after_the_timeout_and_leaves_no_ticket(locks: Path) -> None:
    gpus = inventory().gpus
    with claim(gpus), pytest.raises(WaitTimeoutError) as info:
        wait_and_claim(1, Criteria.make(), timeout=0.2, poll=0.05)
    assert info.value.exit_code == 124
    assert [p for p in (locks / "queue").iterdir()] == []


def test_waiting_fails_at_once_when_no_gpu_could_ever_qualify() -> None:
    start = time.monotonic()
    with pytest.raises(NoGpuAvailableError, match="Waiting cannot help"):
        wait_and_claim(1, Criteria.make(min_free="100GiB"), timeout=30, poll=0.05)
    assert time.monotonic() - start < 5


def test_waiting_claims_only_gpus_that_stayed_free_for_settle_polls() -> None:
    idle = inventory()
    busy_gpu = replace(idle.gpus[0], processes=(GpuProcess(9, "bob", "loading", None),))
    # GPU 0 looks free on every other poll (a neighbour still loading): never settled.
    flicker = Inventory(gpus=(busy_gpu, *idle.gpus[1:]))
    readings = iter([idle, flicker, idle, flicker, idle, idle, idle, idle])
    only_gpu0 = Criteria.make(exclude=[1, 2, 3])
    polls = []

    def read() -> Inventory:
        polls.append(1)
        return next(readings)

    with wait_and_claim(1, only_gpu0, settle=3, poll=0.01, read=read) as held:
        assert held.indices == [0]
    assert len(polls) == 7  # three idle readings in a row first happen at the 7th


def test_waiting_reports_its_status() -> None:
    seen: list[str] = []
    with claim(inventory().gpus), pytest.raises(WaitTimeoutError):
        wait_and_claim(2, Criteria.make(), timeout=0.1, poll=0.05, on_status=seen.append)
    assert seen
    assert "waiting for 2 GPUs" in seen[0]
    assert "0 of 4 qualify" in seen[0]


def test_a_timeout_while_gpus_qualify_says_they_had_not_settled_yet() -> None:
    with pytest.raises(WaitTimeoutError, match=r"Only 0 qualified for 3 polls in a row"):
        wait_and_claim(1, Criteria.make(), timeout=0, settle=3, poll=0.01)


def test_why_a_timed_out_wait_missed_qualifying_gpus_is_a_line_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lost = L4.parent / "kaggle-2xT4-one-lost.json"
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(lost))
    with pytest.raises(WaitTimeoutError) as caught:
        wait_and_claim(1, Criteria.make(), timeout=0, settle=3, poll=0.01)
    lines = caught.value.message.splitlines()
    assert lines[-2:] == [
        "  GPU 1: unreadable by NVML (GPU is lost)",
        "Only 0 qualified for 3 polls in a row (--settle).",
    ]
