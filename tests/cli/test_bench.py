"""`gpukit bench`: suites, JSON output and bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import CliRunner


def test_bench_writes_ratios_against_alternatives_as_json(
    run_cli: CliRunner, tmp_path: Path
) -> None:
    for name in ("accelerate", "lightning"):
        pytest.importorskip(name, reason=f"{name} is not installed (pip install 'gpukit[bench]')")
    out = tmp_path / "bench.json"
    result = run_cli("bench", "--only", "transfer", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    assert payload["schema"] == "gpukit.bench/1"
    assert payload["machine"]["cpu_count"] >= 1
    against = {r["baseline_name"] for r in payload["results"]}
    assert {"accelerate.send_to_device", "lightning.move_data_to_device"} <= against
    for r in payload["results"]:
        assert r["value"] > 0
        assert r["ratio"] == r["value"] / r["baseline_value"]
    assert "transfer" in result.stdout


def test_unknown_suite_is_a_usage_error(run_cli: CliRunner) -> None:
    result = run_cli("bench", "--only", "nope")
    assert result.returncode == 2
    assert "unknown suite nope" in result.stderr


def test_a_suite_whose_alternative_is_missing_is_skipped_with_a_note(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpukit.cli.main import main

    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "accelerate.utils", None)
    assert main(["bench", "--only", "batch_size", "--quick"]) == 0
    err = capsys.readouterr().err
    assert "skipped batch_size: accelerate" in err
    assert "pip install 'gpukit[bench]'" in err
