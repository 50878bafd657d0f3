"""The ledger of claims and the usage it adds up: what an admin counting GPU-hours relies on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpukit.sharing import ledger
from gpukit.sharing.claims import claim, shared_folder
from gpukit.sharing.usage import held_runs, usage
from tests.helpers import ROOT

UUID_A = "GPU-00000000-0000-0000-0000-00000000000a"
UUID_B = "GPU-00000000-0000-0000-0000-00000000000b"


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    return folder


def _own_file(locks: Path) -> Path:
    return locks / f"ledger-{os.getuid()}.jsonl"


def _write(path: Path, *records: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for record in records:
            f.write(json.dumps({"schema": ledger.SCHEMA, "uid": os.getuid(), **record}) + "\n")


def _start(claim_id: str, at: float, gpus: list[str], pid: int = 1) -> dict[str, object]:
    return {"event": "start", "claim": claim_id, "time": at, "gpus": gpus, "pid": pid}


def _end(claim_id: str, at: float, code: int | None = None) -> dict[str, object]:
    return {"event": "end", "claim": claim_id, "time": at, "exit_code": code}


def test_a_released_claim_is_one_run_with_its_gpus_command_and_exit_code(locks: Path) -> None:
    held = claim([UUID_A, UUID_B], command="python train.py")
    held.release(exit_code=3)
    [run] = held_runs()
    assert (run.gpus, run.command, run.exit_code, run.pid) == (
        (UUID_A, UUID_B),
        "python train.py",
        3,
        os.getpid(),
    )
    assert run.end is not None
    assert run.end >= run.start
    assert not run.held


def test_a_claim_still_held_counts_up_to_now(locks: Path) -> None:
    with claim([UUID_A, UUID_B], command="train"):
        [run] = held_runs()
        report = usage(until=run.start + 100)
    assert run.held
    [user] = report.users
    assert (user.gpu_seconds, user.runs, user.held_now, user.longest_run_s) == (200, 1, 1, 100)


def test_usage_counts_only_the_part_of_each_run_inside_the_period(locks: Path) -> None:
    _write(
        _own_file(locks),
        _start("a", 1000.0, [UUID_A, UUID_B]),
        _end("a", 1100.0, 0),
        _start("b", 1200.0, [UUID_A]),
        _end("b", 1500.0, 1),
        _start("c", 100.0, [UUID_A]),
        _end("c", 200.0, 0),
    )
    [user] = usage(since=1050.0, until=2000.0).users
    # a: 50 s x 2 GPUs inside; b: 300 s x 1; c ended before the period.
    assert (user.gpu_seconds, user.runs, user.longest_run_s) == (400.0, 2, 300.0)


def test_a_record_that_names_another_uid_is_not_believed(locks: Path) -> None:
    path = _own_file(locks)
    _write(path, _start("mine", 1000.0, [UUID_A]), _end("mine", 1010.0))
    forged = {"schema": ledger.SCHEMA, "uid": os.getuid() + 4242, "event": "start"}
    with path.open("a") as f:
        f.write(json.dumps({**forged, "claim": "theirs", "time": 0.0, "gpus": [UUID_B]}) + "\n")
    assert [r.claim for r in held_runs()] == ["mine"]
    assert [u.uid for u in usage(until=2000.0).users] == [os.getuid()]


def test_a_line_cut_short_by_a_killed_writer_is_skipped_and_the_next_record_kept(
    locks: Path,
) -> None:
    path = _own_file(locks)
    _write(path, _start("a", 1000.0, [UUID_A]))
    with path.open("a") as f:
        f.write('{"schema": "gpukit.ledger/1", "event": "end", "cla')  # killed mid-write
    claim([UUID_B], command="next").release(exit_code=0)
    runs = held_runs()
    assert [r.command for r in runs] == [None, "next"]
    assert runs[1].exit_code == 0


def test_a_run_whose_holder_died_silently_ends_when_its_gpu_is_next_claimed(
    locks: Path,
) -> None:
    _write(
        _own_file(locks),
        _start("killed", 1000.0, [UUID_A], pid=999_999_999),
        _start("next", 1600.0, [UUID_A, UUID_B]),
        _end("next", 1700.0),
        _start("lost", 1800.0, [UUID_B], pid=999_999_999),
    )
    runs = {r.claim: r for r in held_runs()}
    assert runs["killed"].end == 1600.0
    assert runs["lost"].end is None
    [user] = usage(until=5000.0).users
    assert (user.gpu_seconds, user.runs, user.unknown_end) == (600.0 + 200.0, 3, 1)
    # "lost" began before this period and its end is unknown: it does not haunt later periods.
    assert usage(since=1900.0, until=5000.0).users == ()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to write a file as another user")
def test_a_co_users_record_cannot_lengthen_a_run_whose_holder_died_silently(locks: Path) -> None:
    _write(_own_file(locks), _start("killed", 1000.0, [UUID_A], pid=999_999_999))
    # A co-user appends a start on the same GPU to their own file, as late as they like: the
    # killed run would count until then (in this user's name), however short it really was.
    theirs = locks / "ledger-65534.jsonl"
    forged = {"schema": ledger.SCHEMA, "uid": 65534, "claim": "forged", "pid": 1}
    theirs.write_text(json.dumps({**forged, "event": "start", "time": 90000.0, "gpus": [UUID_A]}))
    os.chown(theirs, 65534, 65534)
    runs = {r.claim: r for r in held_runs()}
    assert runs["killed"].end is None
    mine = [u for u in usage(until=99000.0).users if u.uid == os.getuid()]
    assert [(u.gpu_seconds, u.unknown_end) for u in mine] == [(0.0, 1)]
    # Once its own user claims the GPU again, anyone's earlier claim of it ends the run.
    _write(_own_file(locks), _start("again", 95000.0, [UUID_A]), _end("again", 95001.0))
    assert {r.claim: r for r in held_runs()}["killed"].end == 90000.0


def test_a_claim_never_released_ends_with_its_process(locks: Path) -> None:
    code = (
        f"from gpukit.sharing.claims import claim\nclaim([{UUID_A!r}], command='held to the end')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    [run] = held_runs()
    assert (run.command, run.exit_code) == ("held to the end", None)
    assert run.end is not None


def test_a_claimer_killed_with_sigkill_leaves_a_readable_ledger(locks: Path) -> None:
    code = (
        "import time\nfrom gpukit.sharing.claims import claim\n"
        f"claim([{UUID_A!r}], command='killed')\nprint('held', flush=True)\ntime.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    assert [r.held for r in held_runs()] == [True]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    claim([UUID_A], command="after").release(exit_code=0)
    killed, after = held_runs()
    assert (killed.command, killed.held, killed.end) == ("killed", False, after.start)


def test_the_ledger_never_writes_through_a_link_planted_under_its_name(
    locks: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    locks.mkdir()
    _own_file(locks).symlink_to(victim)
    claim([UUID_A], command="job").release(exit_code=0)
    assert victim.read_text() == "precious\n"
    assert [r.command for r in held_runs()] == ["job"]
    assert (locks / ledger.ledger_name(os.getuid(), 1)).is_file()


def test_a_claim_holds_when_every_ledger_name_is_taken_and_says_it_is_not_recorded(
    locks: Path, tmp_path: Path
) -> None:
    locks.mkdir()
    for n in range(8):
        (locks / ledger.ledger_name(os.getuid(), n)).symlink_to(tmp_path / f"elsewhere{n}")
    with pytest.warns(RuntimeWarning, match="not in the ledger"):
        held = claim([UUID_A], command="job")
    assert held.held
    held.release()
    assert list(tmp_path.glob("elsewhere*")) == []
    assert held_runs() == []


def test_a_co_user_locking_your_ledger_file_cannot_hang_your_claims(
    locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledger, "_LOCK_WAIT_S", 0.2)
    claim([UUID_A]).release()  # the ledger file exists, readable by every user
    # Reading is all flock needs: any user who can read the file can lock it, for ever.
    jammer = subprocess.Popen(
        [sys.executable, "-c", _JAM, str(_own_file(locks))], stdout=subprocess.PIPE, text=True
    )
    assert jammer.stdout is not None
    assert jammer.stdout.readline() == "locked\n"
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(20)
    try:
        with pytest.warns(RuntimeWarning, match="not in the ledger"):
            held = claim([UUID_B], command="job")
        assert held.held
        held.release()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        jammer.kill()
        jammer.wait()


_JAM = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH)
print("locked", flush=True)
time.sleep(600)
"""


def _hung(signum: int, frame: object) -> None:
    raise AssertionError("the claim hung on a ledger file another process keeps locked")


def test_ledger_records_are_readable_by_every_user_and_writable_by_their_owner_only(
    locks: Path,
) -> None:
    claim([UUID_A]).release()
    assert _own_file(locks).stat().st_mode & 0o777 == 0o644


def _claimer(folder: str, worker: int, claims: int, uid: int | None) -> None:
    """One of the concurrent claimers: ``claims`` claims of a shared GPU, on a known clock."""
    import time

    from gpukit.errors import ClaimError
    from gpukit.sharing import claims as claims_module

    if uid is not None:
        os.setgid(uid)
        os.setuid(uid)
    now = [0.0]
    time.time = lambda: now[0]  # claims and the ledger read the clock only through time.time
    gpus = [f"GPU-00000000-0000-0000-0000-0000000000{i:02d}" for i in range(4)]
    for k in range(claims):
        start = 10_000.0 * worker + 100.0 * k
        now[0] = start
        while True:
            try:
                held = claims_module.claim(
                    [gpus[(worker + k) % 4]], command=f"w{worker}", folder=Path(folder)
                )
                break
            except ClaimError:
                continue
        now[0] = start + worker + 1
        held.release(exit_code=k)


@pytest.mark.slow
def test_16_concurrent_claimers_of_20_claims_each_leave_320_runs_and_exact_totals(
    locks: Path,
) -> None:
    import multiprocessing
    import shutil
    import tempfile

    as_root = os.getuid() == 0
    # Each worker its own user when root may switch: the ledger keeps one file per user.
    base = Path(tempfile.mkdtemp(prefix="gpukit-ledger-", dir="/tmp")) if as_root else locks
    folder = base / "locks"
    try:
        base.chmod(0o755)
        uids = [20_000 + w if as_root else None for w in range(16)]
        ctx = multiprocessing.get_context("fork")
        workers = [
            ctx.Process(target=_claimer, args=(str(folder), w, 20, uids[w])) for w in range(16)
        ]
        shared_folder(folder)
        # Lock files made beforehand, as `gpukit setup-locks` does: a new lock file has the
        # umask's mode until its creator widens it, a moment in which another user cannot open
        # it. That race belongs to the lock files; this test counts the ledger.
        for i in range(4):
            lock = folder / f"GPU-00000000-0000-0000-0000-0000000000{i:02d}.lock"
            lock.touch()
            lock.chmod(0o666)
        for p in workers:
            p.start()
        for p in workers:
            p.join(timeout=300)
        assert [p.exitcode for p in workers] == [0] * 16
        lines = [
            json.loads(line)
            for path in folder.glob("ledger-*.jsonl")
            for line in path.read_text().splitlines()
        ]
        assert sorted(r["event"] for r in lines) == ["end"] * 320 + ["start"] * 320
        runs = held_runs(folder)
        assert len(runs) == 320
        assert all(r.end is not None and not r.held for r in runs)
        report = usage(until=1e9, folder=folder)
        assert sum(u.runs for u in report.users) == 320
        assert sum(u.gpu_seconds for u in report.users) == 20 * sum(w + 1 for w in range(16))
        if as_root:
            by_uid = {u.uid: u for u in report.users}
            for w in range(16):
                mine = by_uid[20_000 + w]
                assert (mine.runs, mine.gpu_seconds, mine.longest_run_s) == (
                    20,
                    20 * (w + 1),
                    w + 1,
                )
    finally:
        if as_root:
            shutil.rmtree(base)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_the_ledger_never_appends_to_a_file_another_user_planted_under_its_name(
    locks: Path,
) -> None:
    folder = locks / "ledger"
    folder.mkdir(parents=True)
    planted = _own_file(locks)
    planted.write_text("theirs\n")
    os.chown(planted, 65534, 65534)
    planted.chmod(0o666)
    claim([UUID_A], command="job").release(exit_code=0)
    assert planted.read_text() == "theirs\n"
    assert [r.command for r in held_runs()] == ["job"]
