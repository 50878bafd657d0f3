"""`gpukit bench`: suites, JSON output and bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

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


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_in_a_missing_folder_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    option: str,
) -> None:
    from gpukit.cli import bench
    from gpukit.cli.main import main

    monkeypatch.setattr(bench, "SUITES", {})  # any suite that ran would be a failure
    target = tmp_path / "missing" / "dir" / "b.json"
    with pytest.raises(SystemExit) as exited:
        main(["bench", option, str(target)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"the folder {target.parent} does not exist" in err
    assert "Traceback" not in err


def test_plot_without_matplotlib_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import importlib.util

    from gpukit.cli import bench
    from gpukit.cli.main import main

    ran: list[bool] = []
    suite = SimpleNamespace(run=lambda quick: ran.append(quick) or [])
    monkeypatch.setitem(sys.modules, "recording_suite", suite)
    monkeypatch.setattr(bench, "SUITES", {"recording": "recording_suite"})
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    assert main(["bench", "--plot", str(tmp_path / "b.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert ran == []


def test_the_json_is_never_written_through_a_link_planted_after_the_check(tmp_path: Path) -> None:
    from gpukit.cli.bench import _write_new_or_own

    mine = tmp_path / "bashrc"
    mine.write_text("keep me")
    (tmp_path / "b.json").symlink_to(mine)
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        _write_new_or_own(str(tmp_path / "b.json"), "{}")
    assert mine.read_text() == "keep me"
    _write_new_or_own(str(tmp_path / "c.json"), "{}")
    assert (tmp_path / "c.json").read_text() == "{}"
