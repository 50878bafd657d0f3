"""`gpukit info` and the command's entry point."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import CliRunner


def test_info_json_reports_torch_cuda_cudnn_and_cpu(run_cli: CliRunner) -> None:
    result = run_cli("info", "--json", env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["schema"] == "gpukit.info/1"
    assert info["torch"].startswith("2.")
    assert set(info["cuda"]) >= {"available", "device_count", "devices", "arch_list"}
    assert info["environment"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert info["cpu"]["torch_threads"] >= 1


def test_info_without_a_gpu_says_so_plainly(run_cli: CliRunner) -> None:
    result = run_cli("info", env={"NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("No GPU")
    assert "cuDNN" in result.stdout
    assert "\x1b[" not in result.stdout  # no colour codes into a pipe


def test_no_arguments_is_a_usage_error_with_the_help_and_exit_codes_on_stderr(
    run_cli: CliRunner,
) -> None:
    result = run_cli()
    assert result.returncode == 2
    assert result.stdout == ""
    assert "exit codes" in result.stderr
    assert "124" in result.stderr


def test_unknown_command_is_a_usage_error(run_cli: CliRunner) -> None:
    result = run_cli("frobnicate")
    assert result.returncode == 2
    assert "unknown command 'frobnicate'" in result.stderr
    assert "Traceback" not in result.stderr


def test_version_is_printed(run_cli: CliRunner) -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("gpukit ")


def test_info_shows_the_drivers_view_beside_torchs(run_cli: CliRunner, machines_dir: Path) -> None:
    machine = machines_dir / "server-8xA100-shared.json"
    result = run_cli("info", "--json", env={"GPUKIT_FAKE_NVML": str(machine)})
    assert result.returncode == 0, result.stderr
    nvml = json.loads(result.stdout)["nvml"]
    assert nvml["schema"] == "gpukit.inventory/1"
    assert len(nvml["gpus"]) == 8
    assert "fake machine" in result.stderr


def test_info_without_a_driver_still_reports_torch(run_cli: CliRunner, machines_dir: Path) -> None:
    machine = machines_dir / "no-driver.json"
    result = run_cli("info", env={"GPUKIT_FAKE_NVML": str(machine)})
    assert result.returncode == 0, result.stderr
    assert "NVML (the driver's view): not available" in result.stdout
    assert "torch" in result.stdout
