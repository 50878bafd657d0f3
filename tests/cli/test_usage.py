"""`gpukit usage`: GPU time per user from the ledger, as an admin reads it."""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpukit.cli.usage import parse_since
from gpukit.errors import InvalidArgumentError
from gpukit.sharing.ledger import SCHEMA as LEDGER_SCHEMA
from gpukit.sharing.usage import SCHEMA, held_runs
from tests.helpers import MACHINES

if TYPE_CHECKING:
    from tests.helpers import CliRunner

L4 = MACHINES / "server-4xL4-idle.json"
NOW = 1_800_000_000.0


def _env(locks: Path) -> dict[str, str | None]:
    return {"GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(locks)}


def _ledger(locks: Path, *runs: tuple[str, float, float, int]) -> None:
    """Write finished runs (claim id, start, end, number of GPUs) into this user's ledger."""
    path = locks / f"ledger-{os.geteuid()}.jsonl"
    path.parent.mkdir(parents=True)
    with path.open("w") as f:
        for claim, start, end, n in runs:
            base = {"schema": LEDGER_SCHEMA, "uid": os.geteuid(), "claim": claim}
            gpus = [f"GPU-{i}" for i in range(n)]
            f.write(json.dumps({**base, "event": "start", "time": start, "gpus": gpus}) + "\n")
            f.write(json.dumps({**base, "event": "end", "time": end, "exit_code": 0}) + "\n")


def test_gpukit_run_records_the_exit_code_of_its_command(
    run_cli: CliRunner, tmp_path: Path
) -> None:
    locks = tmp_path / "locks"
    ran = run_cli(
        "run", "-n", "2", "--", sys.executable, "-c", "raise SystemExit(3)", env=_env(locks)
    )
    assert ran.returncode == 3, ran.stderr
    [run] = held_runs(locks)
    assert (run.exit_code, len(run.gpus), run.held) == (3, 2, False)
    assert run.command is not None
    assert run.command.endswith("'raise SystemExit(3)'")
    report = run_cli("usage", "--json", env=_env(locks))
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert data["schema"] == SCHEMA
    [user] = data["users"]
    assert (user["uid"], user["runs"], user["held_now"]) == (os.geteuid(), 1, 0)


def test_usage_adds_up_gpu_hours_runs_and_the_longest_run(
    run_cli: CliRunner, tmp_path: Path
) -> None:
    locks = tmp_path / "locks"
    _ledger(locks, ("a", 1000.0, 1000.0 + 5400, 2), ("b", 9000.0, 9000.0 + 1800, 1))
    result = run_cli("usage", "--since", "all", "--json", env=_env(locks))
    [user] = json.loads(result.stdout)["users"]
    assert (user["gpu_seconds"], user["gpu_hours"], user["runs"], user["longest_run_s"]) == (
        12600.0,
        3.5,
        2,
        5400.0,
    )
    table = run_cli("usage", "--since", "all", env=_env(locks)).stdout
    row = next(line for line in table.splitlines() if line.split()[1:2] == ["3.50"])
    assert row.split()[2:4] == ["2", "1.50"]


def test_usage_says_so_when_nobody_claimed_anything(run_cli: CliRunner, tmp_path: Path) -> None:
    result = run_cli("usage", env=_env(tmp_path / "locks"))
    assert result.returncode == 0
    assert "No claims in the ledger since" in result.stdout


@pytest.mark.parametrize(
    ("text", "seconds_back"),
    [("7d", 7 * 86400), ("24h", 86400), ("30m", 1800), ("2w", 14 * 86400), ("1.5h", 5400)],
)
def test_since_takes_a_span_back_from_now(text: str, seconds_back: float) -> None:
    assert parse_since(text, NOW) == NOW - seconds_back


def test_since_takes_a_date_as_local_midnight_and_all_as_no_limit() -> None:
    assert parse_since("2026-11-01", NOW) == dt.datetime(2026, 11, 1).timestamp()
    assert parse_since("2026-11-01T09:30", NOW) == dt.datetime(2026, 11, 1, 9, 30).timestamp()
    assert parse_since("all", NOW) is None


@pytest.mark.parametrize(
    "text", ["yesterday", "7", "-3d", "2027-13-01", "2099-01-01", "0001-01-01", "9999999999d"]
)
def test_since_refuses_what_is_not_a_past_moment(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="--since"):
        parse_since(text, NOW)


def test_a_bad_since_exits_2_without_a_traceback(run_cli: CliRunner, tmp_path: Path) -> None:
    result = run_cli("usage", "--since", "last week", env=_env(tmp_path / "locks"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--since 'last week'" in result.stderr
