"""`gpukit demo` as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpukit.cli.main import main
from tests.helpers import CliRunner


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


def test_demo_json_says_its_precision_and_micro_batches(run_cli: CliRunner) -> None:
    args = ("--epochs", "1", "--precision", "bf16-mixed", "--accumulate", "2", "--json")
    result = run_cli("demo", "--replicas", "2", *args)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["extra"] == {"precision": "bf16-mixed", "accumulate": 2, "skipped_steps": 0}


def test_fp16_on_cpu_replicas_is_a_usage_error_naming_the_alternatives(run_cli: CliRunner) -> None:
    result = run_cli("demo", "--replicas", "2", "--precision", "fp16-mixed")
    assert result.returncode == 2
    assert "fp16-mixed" in result.stderr
    assert "bf16-mixed" in result.stderr
    assert "Traceback" not in result.stderr


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


def _result(seconds: float) -> Any:
    from gpukit.demo import DemoResult

    return DemoResult(
        devices=["cpu"], epochs=1, batch_size=64, seed=0, train_samples=1, test_samples=1,
        replica_batch_sizes=[16], gathered_output_shape=[16, 10], epoch_losses=[0.1],
        epoch_accuracies=[0.9], test_accuracy=0.9, reloaded_accuracy=0.9, checkpoint=None,
        prefixes_removed=[], seconds=seconds, samples_per_second=100.0,
    )  # fmt: skip


def test_demo_says_what_it_loads_before_anything_else(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gpukit.demo

    printed_before: list[str] = []

    def run_demo(*args: object, **kwargs: object) -> Any:
        printed_before.append(capsys.readouterr().out)
        return _result(1.0)

    monkeypatch.setattr(gpukit.demo, "run_demo", run_demo)
    assert main(["demo", "--replicas", "1"]) == 0
    assert printed_before == ["Loading torch and the digits data...\n"]


def test_done_in_counts_the_loading_time_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gpukit.demo
    from gpukit.cli import demo as demo_command

    clock = iter([100.0, 117.5])  # the command's start, then its end
    monkeypatch.setattr(demo_command.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(gpukit.demo, "run_demo", lambda *a, **k: _result(2.0))
    assert main(["demo", "--replicas", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("Done in 17.5 s (training 2.0 s, 100 samples/s)")


def test_demo_says_its_checkpoint_is_temporary_and_how_to_keep_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--replicas", "1", "--epochs", "1"]) == 0
    [saved] = [line for line in capsys.readouterr().out.splitlines() if "gk.save" in line]
    assert saved.startswith("Saved with gk.save to a temporary file: ")
    assert saved.endswith("removed when the demo ends; --save FILE keeps it.")
    path = saved.split(": ", 1)[1].split(" (", 1)[0]
    assert not Path(path).exists()


@pytest.mark.usefixtures("no_training")
@pytest.mark.parametrize(
    ("devices", "says"),
    [
        ("meta", "holds shapes but no data"),
        ("cpu,meta", "holds shapes but no data"),
        ("xpu", "trains on cpu, cuda and mps devices only"),
    ],
)
def test_a_device_the_demo_cannot_train_on_is_a_usage_error_before_training(
    devices: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--devices", devices]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpukit demo: the demo cannot train on {devices.split(',')[-1]!r}")
    assert says in err
    assert "--devices cpu,cpu" in err  # the next step
