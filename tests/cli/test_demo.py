"""`gpukit demo` as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpukit.cli.main import main
from tests.conftest import CliRunner


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the demo starts training: the mistakes below must be found first."""
    import gpukit.demo

    def run_demo(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started training")

    monkeypatch.setattr(gpukit.demo, "run_demo", run_demo)


def test_demo_json_summary_on_cpu_replicas(run_cli: CliRunner) -> None:
    result = run_cli("demo", "--replicas", "2", "--epochs", "2", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["schema"] == "gpukit.demo/1"
    assert summary["devices"] == ["cpu", "cpu"]
    assert summary["replica_batch_sizes"] == [8, 8]
    assert summary["reloaded_accuracy"] == summary["test_accuracy"]


def test_demo_tells_the_story_in_plain_lines(run_cli: CliRunner) -> None:
    result = run_cli("demo", "--devices", "cpu,cpu,cpu,cpu", "--epochs", "1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("batch size in forward: 4") == 4
    assert "gathered output for a batch of 16: [16, 10]" in out
    assert "epoch 1: loss" in out
    assert "matches the trained model" in out


def test_bad_device_is_a_usage_error_without_traceback(run_cli: CliRunner) -> None:
    result = run_cli("demo", "--devices", "gpu")
    assert result.returncode == 2
    assert "Did you mean" in result.stderr
    assert "Traceback" not in result.stderr


def test_zero_replicas_is_a_usage_error(run_cli: CliRunner) -> None:
    result = run_cli("demo", "--replicas", "0")
    assert result.returncode == 2
    assert "argument --replicas: '0' is not a whole number from 1" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.usefixtures("no_training")
@pytest.mark.parametrize(
    ("save", "says"),
    [
        ("folder.pt", "is an existing folder"),
        ("missing/digits.pt", "the folder {tmp}/missing does not exist"),
        ("file.txt/digits.pt", "the folder {tmp}/file.txt is not a folder"),
    ],
)
def test_a_save_path_that_cannot_be_written_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], save: str, says: str
) -> None:
    (tmp_path / "folder.pt").mkdir()
    (tmp_path / "file.txt").write_text("")
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--save", str(tmp_path / save)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert says.format(tmp=tmp_path) in err
    assert err.startswith("gpukit demo: error: argument --save: ")


@pytest.mark.usefixtures("no_training")
def test_a_save_suffix_gpukit_cannot_write_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--save", str(tmp_path / "digits.txt")]) == 2
    assert "'.txt' is not one it knows" in capsys.readouterr().err


@pytest.mark.usefixtures("no_training")
@pytest.mark.parametrize("devices", ["", ",", " , "])
def test_a_devices_list_that_names_no_device_is_refused(
    devices: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--devices", devices]) == 2
    assert "names no device" in capsys.readouterr().err
