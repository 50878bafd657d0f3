"""`gpukit list`, run as a user runs it: a subprocess against fake machines."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpukit.gpus.inventory import SCHEMA, Inventory
from tests.helpers import MACHINES, ROOT

if TYPE_CHECKING:
    from tests.helpers import CliRunner

DESCRIPTIONS = sorted(MACHINES.glob("*.json"))


def _fake(machines_dir: Path, name: str) -> dict[str, str | None]:
    return {
        "GPUKIT_FAKE_NVML": str(machines_dir / f"{name}.json"),
        "CUDA_VISIBLE_DEVICES": None,
        "CUDA_DEVICE_ORDER": None,
    }


@pytest.mark.parametrize(
    "machine",
    [m for m in DESCRIPTIONS if m.stem not in ("no-driver", "kaggle-2xT4-one-lost")],
    ids=lambda p: p.stem,
)
def test_list_json_round_trips_into_an_inventory(run_cli: CliRunner, machine: Path) -> None:
    result = run_cli("list", "--json", env={"GPUKIT_FAKE_NVML": str(machine)})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["schema"] == SCHEMA
    described = json.loads(machine.read_text())
    assert [g.uuid for g in Inventory.from_json(data).gpus] == [
        g["uuid"] for g in described["gpus"]
    ]


def test_list_says_on_stderr_that_it_reads_a_fake_machine(
    run_cli: CliRunner, machines_dir: Path
) -> None:
    result = run_cli("list", env=_fake(machines_dir, "kaggle-2xT4-idle"))
    assert "fake machine" in result.stderr
    assert "kaggle-2xT4-idle.json" in result.stderr


def test_list_shows_one_line_per_gpu_with_its_users(run_cli: CliRunner, machines_dir: Path) -> None:
    result = run_cli("list", env=_fake(machines_dir, "server-8xA100-shared"))
    assert result.returncode == 0, result.stderr
    gpu_lines = [line for line in result.stdout.splitlines() if "A100-SXM4-80GB" in line]
    assert len(gpu_lines) == 8
    assert "alice:40211 python train.py" in gpu_lines[0]
    assert "98%" in gpu_lines[0]
    assert "bob:51877" in gpu_lines[3]


def test_list_shows_mig_instances_under_their_gpu(run_cli: CliRunner, machines_dir: Path) -> None:
    lines = run_cli("list", env=_fake(machines_dir, "server-2xH100-mig")).stdout.splitlines()
    rows = [line.split()[0] for line in lines[2:] if not line.startswith("lock folder:")]
    assert rows == ["0", "0.0", "0.1", "1"]
    assert "frank:7001" in lines[3]


def test_list_shows_unsupported_readings_as_na(run_cli: CliRunner, machines_dir: Path) -> None:
    result = run_cli("list", env=_fake(machines_dir, "laptop-rtx3060"))
    line = next(line for line in result.stdout.splitlines() if "RTX 3060" in line)
    assert "n/a" in line


def test_list_shows_cuda_index_beside_nvml_index_when_devices_are_restricted(
    run_cli: CliRunner, machines_dir: Path
) -> None:
    env = {
        **_fake(machines_dir, "server-8xA100-shared"),
        "CUDA_VISIBLE_DEVICES": "5,2",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    lines = run_cli("list", env=env).stdout.splitlines()
    assert "CUDA" in lines[1]
    by_gpu = {line.split()[0]: line.split()[1] for line in lines[2:]}
    assert by_gpu["5"] == "cuda:0"
    assert by_gpu["2"] == "cuda:1"
    assert by_gpu["0"] == "-"


def test_list_warns_about_cuda_order_on_the_mixed_workstation(
    run_cli: CliRunner, machines_dir: Path
) -> None:
    result = run_cli("list", env=_fake(machines_dir, "workstation-mixed-order"))
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in result.stdout


def test_list_without_a_driver_exits_3_with_one_clear_line(
    run_cli: CliRunner, machines_dir: Path
) -> None:
    for args in (("list",), ("list", "--json")):
        result = run_cli(*args, env=_fake(machines_dir, "no-driver"))
        assert result.returncode == 3
        errors = [line for line in result.stderr.splitlines() if "fake machine" not in line]
        assert len(errors) == 1
        assert "No NVIDIA driver" in errors[0]
        assert "Traceback" not in result.stderr
        assert result.stdout == ""


def test_list_on_this_machine_without_nvidia_driver_exits_3(run_cli: CliRunner) -> None:
    if Path("/proc/driver/nvidia").exists():
        pytest.skip("this machine has an NVIDIA driver")
    result = run_cli("list")
    assert result.returncode == 3
    assert "Traceback" not in result.stderr


def _colours(text: str) -> list[str]:
    """The SGR colour codes in ``text`` (foreground/background; bold and dim are not colours)."""
    return re.findall(r"\x1b\[(?:3[0-9]|4[0-9]|9[0-7])[0-9;]*m", text)


def test_list_respects_no_color(run_cli: CliRunner, machines_dir: Path) -> None:
    # FORCE_COLOR stands in for a terminal; the yellow CUDA-order note is the coloured part.
    env = {
        **_fake(machines_dir, "workstation-mixed-order"),
        "FORCE_COLOR": "1",
        "TERM": "xterm-256color",
    }
    assert _colours(run_cli("list", env={**env, "NO_COLOR": None}).stdout)
    assert _colours(run_cli("list", env={**env, "NO_COLOR": "1"}).stdout) == []


def test_list_to_a_pipe_has_no_escape_codes(run_cli: CliRunner, machines_dir: Path) -> None:
    env = {**_fake(machines_dir, "workstation-mixed-order"), "FORCE_COLOR": None, "NO_COLOR": None}
    assert "\x1b[" not in run_cli("list", env=env).stdout


def test_list_never_imports_torch(machines_dir: Path) -> None:
    code = (
        "import sys; from gpukit.cli.main import main; rc = main(['list', '--json']);"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "GPUKIT_FAKE_NVML": str(machines_dir / "server-8xA100-shared.json"),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stderr.strip().splitlines()[-1] == "False"


def test_watch_json_prints_a_reading_per_interval_until_interrupted(machines_dir: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "GPUKIT_FAKE_NVML": str(machines_dir / "kaggle-2xT4-idle.json"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "list", "--json", "--watch", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while len(lines) < 3 and time.monotonic() < deadline:
        lines.append(proc.stdout.readline())
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    readings = [json.loads(line) for line in lines]
    assert all(r["schema"] == SCHEMA for r in readings)
    assert readings[0]["taken_at"] < readings[2]["taken_at"]


def test_list_shows_who_has_claimed_each_gpu(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    from gpukit.sharing.claims import claim

    machine = str(machines_dir / "server-4xL4-idle.json")
    env = {"GPUKIT_FAKE_NVML": machine, "GPUKIT_LOCK_DIR": str(tmp_path), "NO_COLOR": "1"}
    uuid = json.loads(run_cli("list", "--json", env=env).stdout)["gpus"][1]["uuid"]
    with claim([uuid], command="python train.py", folder=tmp_path):
        table = run_cli("list", env=env).stdout
        claims = json.loads(run_cli("list", "--json", env=env).stdout)["claims"]
    assert "claimed by" in table
    row = next(line for line in table.splitlines() if line.strip().startswith("1 "))
    assert "python train.py" in row
    assert claims[uuid]["command"] == "python train.py"
    after = run_cli("list", env=env).stdout
    assert "claimed by" not in after


def test_list_shows_a_command_line_with_brackets_as_it_is(
    run_cli: CliRunner, machines_dir: Path, tmp_path: Path
) -> None:
    machine = json.loads((machines_dir / "server-8xA100-shared.json").read_text())
    command = "python train.py tags=[red] [/x]"
    machine["gpus"][0]["processes"][0]["name"] = command
    path = tmp_path / "brackets.json"
    path.write_text(json.dumps(machine))
    result = run_cli("list", env={"GPUKIT_FAKE_NVML": str(path), "GPUKIT_LOCK_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert command in result.stdout


@pytest.mark.parametrize(
    "name", ["server-8xA100-shared", "server-2xH100-mig", "workstation-mixed-order"]
)
def test_list_keeps_every_gpu_index_on_an_80_column_terminal(
    machines_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    from rich.console import Console

    from gpukit.cli.list_gpus import _read, _render

    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(machines_dir / f"{name}.json"))
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    inv, view, locks = _read()
    out = Console(width=80, force_terminal=True, color_system=None, highlight=False)
    with out.capture() as captured:
        out.print(_render(inv, view, locks))
    # the notes below the table wrap, as prose does
    text = re.split("note:|lock folder:", captured.get())[0]
    lines = text.splitlines()
    assert lines[1].split()[0] == "GPU"
    gpu_rows = [line for line in lines[2:] if "└" not in line]
    assert [row.split()[0] for row in gpu_rows] == [str(g.index) for g in inv.gpus]
    assert all(len(line) <= 80 for line in lines)


def test_watch_into_a_pipe_whose_reader_leaves_exits_0(machines_dir: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "GPUKIT_FAKE_NVML": str(machines_dir / "kaggle-2xT4-idle.json"),
        "GPUKIT_LOCK_DIR": str(tmp_path),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "list", "--watch", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # `gpukit list --watch | head -1`
    proc.stdout.close()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


@pytest.mark.parametrize("interval", ["nan", "inf", "1e12", "-1"])
def test_watch_refuses_an_interval_that_is_no_sensible_number_of_seconds_with_exit_2(
    run_cli: CliRunner, machines_dir: Path, interval: str
) -> None:
    env: dict[str, str | None] = {"GPUKIT_FAKE_NVML": str(machines_dir / "kaggle-2xT4-idle.json")}
    done = run_cli("list", "--watch", interval, env=env, timeout=20)
    assert done.returncode == 2, done.stderr
    assert "--watch" in done.stderr
    assert "Traceback" not in done.stderr
