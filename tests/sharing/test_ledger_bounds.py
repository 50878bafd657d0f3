"""The ledger as others' data: no co-user's file can hang, crash or bloat `gpukit usage`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpukit.sharing import ledger
from gpukit.sharing.usage import usage

if TYPE_CHECKING:
    from tests.helpers import CliRunner

UUID_A = "GPU-00000000-0000-0000-0000-00000000000a"
UUID_B = "GPU-00000000-0000-0000-0000-00000000000b"


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    folder.mkdir()
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    return folder


def _record(event: str, claim: str, at: object, uid: int | None = None, **more: object) -> str:
    uid = os.getuid() if uid is None else uid
    fields = {"schema": ledger.SCHEMA, "uid": uid, "event": event, "claim": claim, "time": at}
    return json.dumps({**fields, **more}) + "\n"


def _start(claim: str, at: object, gpus: list[str], uid: int | None = None) -> str:
    return _record("start", claim, at, uid, gpus=gpus, pid=999_999_999)


def _end(claim: str, at: object, uid: int | None = None) -> str:
    return _record("end", claim, at, uid, exit_code=0)


def _write(path: Path, *lines: str, owner: int | None = None) -> Path:
    path.write_text("".join(lines))
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def test_settling_many_claims_never_ended_looks_at_each_claim_a_bounded_number_of_times(
    locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 400
    # Holders killed with SIGKILL record no end: each such run is bounded by the next claim.
    _write(
        locks / ledger.ledger_name(os.getuid()),
        *(_start(f"c{i}", 1000.0 + i, [UUID_A if i % 2 else UUID_B]) for i in range(n)),
    )
    looks = {"gpus": 0, "start": 0}

    class CountedRun(ledger.Run):
        def __getattribute__(self, name: str) -> object:
            if name in looks:
                looks[name] += 1
            return super().__getattribute__(name)

    monkeypatch.setattr(ledger, "Run", CountedRun)
    runs = ledger.read_runs(locks)
    assert [r.end for r in runs] == [1000.0 + i + 2 for i in range(n - 2)] + [None, None]
    # A pairwise comparison of the runs looks at them about n * n / 2 times.
    assert looks["gpus"] <= 8 * n
    assert looks["start"] <= 8 * n


def test_a_deeply_nested_line_is_skipped_and_counted_and_the_other_records_kept(
    locks: Path,
) -> None:
    _write(
        locks / ledger.ledger_name(os.getuid()),
        _start("a", 1000.0, [UUID_A]),
        "[" * 100_000 + "\n",
        '{"schema": "gpukit.ledger/1", "uid": ' + "9" * 5000 + "}\n",
        _end("a", 1100.0),
    )
    report = usage(until=2000.0)
    [user] = report.users
    assert (user.gpu_seconds, user.runs) == (100.0, 1)
    assert report.skipped_lines == 2
    assert "skipped 2 ledger lines" in report.notes[0]


@pytest.mark.parametrize(
    "bad",
    [
        {"time": -1e308},
        {"time": 1e300},
        {"time": "1000"},
        {"time": True},
        {"claim": ["a"]},
        {"uid": float(os.getuid())},
        {"gpus": "GPU-a"},
        {"gpus": [{"uuid": "GPU-a"}]},
    ],
)
def test_a_record_of_the_wrong_type_or_range_is_skipped(
    locks: Path, bad: dict[str, object]
) -> None:
    fields = {"schema": ledger.SCHEMA, "uid": os.getuid(), "event": "start", "claim": "x"}
    line = json.dumps({**fields, "time": 500.0, "gpus": [UUID_B], **bad}) + "\n"
    _write(
        locks / ledger.ledger_name(os.getuid()),
        line,
        _start("a", 1000.0, [UUID_A]),
        _end("a", 1100.0),
    )
    report = usage(until=2000.0)
    assert [(u.gpu_seconds, u.runs) for u in report.users] == [(100.0, 1)]
    assert report.skipped_lines == 1


def test_usage_json_holds_no_infinity_for_a_record_with_a_time_of_minus_1e308(
    locks: Path, run_cli: CliRunner
) -> None:
    _write(
        locks / ledger.ledger_name(os.getuid()),
        _start("far", -1e308, [UUID_A, UUID_B]),
        _end("far", 1000.0),
        _start("a", 1000.0, [UUID_A]),
        _end("a", 1060.0),
    )
    done = run_cli("usage", "--since", "all", "--json", env={"GPUKIT_LOCK_DIR": str(locks)})
    assert done.returncode == 0, done.stderr

    def refuse(name: str) -> float:
        raise AssertionError(f"--json printed {name}")

    data = json.loads(done.stdout, parse_constant=refuse)
    [user] = data["users"]
    assert (user["gpu_seconds"], user["runs"]) == (60.0, 1)
    assert data["skipped_lines"] == 1  # the start of "far"; an end without a start is no run
    assert "gpukit usage: note: skipped 1 ledger line " in done.stderr
    assert all(math.isfinite(v) for v in (data["until"], user["longest_run_s"]))


def test_a_ledger_file_past_the_bound_is_read_from_its_end_and_said_so(
    locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledger, "_MAX_PER_OWNER", 4096)
    lines = [
        _start(f"c{i}", 1000.0 + 10 * i, [UUID_A]) + _end(f"c{i}", 1001.0 + 10 * i)
        for i in range(200)
    ]
    path = _write(locks / ledger.ledger_name(os.getuid()), *lines)
    assert path.stat().st_size > 4 * 4096
    result = ledger.read_ledger(locks)
    claims = [r.claim for r in result.runs]
    assert 10 < len(claims) < 200
    assert claims == [f"c{i}" for i in range(200 - len(claims), 200)]  # the most recent
    assert result.skipped == 0  # a line cut by the bound is not a malformed one
    [note] = result.notes
    assert path.name in note
    assert "older claims are not counted" in note


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_one_users_many_large_files_do_not_crowd_out_anothers_records(
    locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledger, "_MAX_PER_OWNER", 8192)
    monkeypatch.setattr(ledger, "_MAX_TOTAL", 3 * 8192)
    junk = "".join(_start(f"j{i}", 1000.0 + i, [UUID_B], uid=65534) for i in range(300))
    for n in range(1, 6):  # sorted before this user's own file, each past the bound
        _write(locks / f"ledger-0000{n}.jsonl", junk, owner=65534)
    _write(
        locks / ledger.ledger_name(os.getuid()), _start("mine", 5.0, [UUID_A]), _end("mine", 65.0)
    )
    report = usage(until=9000.0)
    mine = [u for u in report.users if u.uid == os.getuid()]
    assert [(u.gpu_seconds, u.runs) for u in mine] == [(60.0, 1)]
    assert any("not read" in note for note in report.notes)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_reading_stops_at_the_bound_in_all_and_says_which_files_were_not_read(
    locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledger, "_MAX_PER_OWNER", 8192)
    monkeypatch.setattr(ledger, "_MAX_TOTAL", 2 * 8192)
    for uid in (65532, 65533, 65534):
        lines = (_start(f"u{uid}-{i}", 1000.0 + i, [UUID_A], uid=uid) for i in range(100))
        _write(locks / f"ledger-{uid}.jsonl", *lines, owner=uid)
    result = ledger.read_ledger(locks)
    assert {r.uid for r in result.runs} == {65532, 65533}
    assert sum(n.endswith("past the bound of reading") for n in result.notes) == 1
    assert any("ledger-65534.jsonl" in n and "not read" in n for n in result.notes)
