"""`gpukit demo` as a user runs it."""

from __future__ import annotations

import json

from tests.conftest import CliRunner


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
    assert "--replicas 0" in result.stderr
