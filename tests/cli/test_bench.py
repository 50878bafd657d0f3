"""`gpukit bench`: suites, JSON output and bad input."""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpukit.bench.core import BenchResult
from tests.helpers import CliRunner


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


@pytest.fixture
def one_suite(monkeypatch: pytest.MonkeyPatch) -> list[Callable[[], None]]:
    """Make ``gpukit bench`` run one stub suite; what the list holds runs during the run."""
    from gpukit.bench import core
    from gpukit.cli import bench

    during: list[Callable[[], None]] = []

    def run(quick: bool) -> list[BenchResult]:
        for act in during:
            act()
        return [
            BenchResult("stub", "a step", 2.0, "ms", "the old way", 4.0, target_ratio=0.8),
            BenchResult("stub", "a rate", 3.0, "1/s", "the old way", 2.0, higher_is_better=True),
        ]

    monkeypatch.setitem(sys.modules, "stub_suite", SimpleNamespace(run=run))
    monkeypatch.setattr(bench, "SUITES", {"stub": "stub_suite"})
    monkeypatch.setattr(core, "machine_description", lambda: {"processor": "x86_64"})
    return during


def test_plot_without_matplotlib_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    one_suite: list[Callable[[], None]],
) -> None:
    from gpukit.cli.main import main

    ran: list[bool] = []
    one_suite.append(lambda: ran.append(True))
    for name in ("matplotlib", "matplotlib.backend_bases"):
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    assert main(["bench", "--plot", str(tmp_path / "b.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert ran == []


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("x.txt", "matplotlib cannot write .txt pictures"),
        ("xplot", "has no suffix, and the suffix names the picture's format"),
        ("x.pgf", "matplotlib cannot write .pgf pictures"),  # it would need TeX to draw text
    ],
)
def test_a_plot_name_matplotlib_cannot_write_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    one_suite: list[Callable[[], None]],
    name: str,
    said: str,
) -> None:
    from gpukit.cli.main import main

    ran: list[bool] = []
    one_suite.append(lambda: ran.append(True))
    assert main(["bench", "--plot", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert said in err
    assert "Traceback" not in err
    assert ran == []
    assert list(tmp_path.iterdir()) == []


def test_bench_writes_the_plot_under_exactly_the_name_given_and_says_where(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, one_suite: list[Callable[[], None]]
) -> None:
    from gpukit.cli.main import main

    plot, results = tmp_path / "ratios.svg", tmp_path / "b.json"
    assert main(["bench", "--plot", str(plot), "--json", str(results)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "ratios.svg"]
    assert plot.read_bytes().lstrip().startswith(b"<?xml")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"wrote the results to {results} and the plot to {plot}"


def test_a_link_planted_at_the_plot_name_during_the_run_is_replaced_not_followed(
    tmp_path: Path, one_suite: list[Callable[[], None]]
) -> None:
    from gpukit.cli.main import main

    victim, plot = tmp_path / "bashrc", tmp_path / "b.png"
    victim.write_text("keep me")
    one_suite.append(lambda: plot.symlink_to(victim))
    assert main(["bench", "--plot", str(plot)]) == 0
    assert victim.read_text() == "keep me"
    assert not plot.is_symlink()
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_a_fifo_planted_at_the_json_name_during_the_run_does_not_hang_the_bench(
    tmp_path: Path, one_suite: list[Callable[[], None]]
) -> None:
    from gpukit.cli.main import main

    out = tmp_path / "b.json"
    one_suite.append(lambda: os.mkfifo(out))
    codes: list[int] = []
    bench = threading.Thread(target=lambda: codes.append(main(["bench", "--json", str(out)])))
    bench.start()
    bench.join(30)
    if bench.is_alive():  # blocked opening the FIFO: a reader lets the open go through
        os.close(os.open(out, os.O_RDONLY | os.O_NONBLOCK))
        bench.join(10)
    assert codes == [0]
    assert stat.S_ISREG(out.lstat().st_mode)
    assert json.loads(out.read_text())["schema"] == "gpukit.bench/1"


def test_the_json_holds_null_for_a_figure_that_is_not_a_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_suite: list[Callable[[], None]]
) -> None:
    from gpukit.cli import bench
    from gpukit.cli.main import main

    nan = BenchResult("stub", "nothing measured", float("nan"), "ms", "the old way", 1.0)
    monkeypatch.setitem(sys.modules, "nan_suite", SimpleNamespace(run=lambda quick: [nan]))
    monkeypatch.setattr(bench, "SUITES", {"nan": "nan_suite"})
    out = tmp_path / "b.json"
    assert main(["bench", "--json", str(out)]) == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the JSON")

    [result] = json.loads(out.read_text(), parse_constant=refuse)["results"]
    assert (result["value"], result["ratio"]) == (None, None)


def test_a_plot_that_fails_to_draw_is_a_one_line_error_and_the_json_is_kept(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    one_suite: list[Callable[[], None]],
) -> None:
    from gpukit.bench import plot
    from gpukit.cli.main import main

    def broken(*args: object, **kwargs: object) -> bytes:
        raise RuntimeError("no codec for that")

    monkeypatch.setattr(plot, "render", broken)
    out = tmp_path / "b.json"
    assert main(["bench", "--json", str(out), "--plot", str(tmp_path / "b.webp")]) == 1
    err = capsys.readouterr().err
    assert "Cannot draw --plot" in err
    assert "RuntimeError: no codec for that" in err
    assert f"in {out}." in err
    assert "Traceback" not in err
    assert json.loads(out.read_text())["schema"] == "gpukit.bench/1"
