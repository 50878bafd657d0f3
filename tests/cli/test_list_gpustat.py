"""`gpukit list --json --format gpustat` prints what `gpustat --json` prints, held to real gpustat.

gpustat 1.1.1's own query code reads the same machine description through gpukit's fake NVML
(tests/helpers/gpustat_driver.py); its processes are real idle processes of this machine, which
gpustat reads with psutil and gpukit from /proc. Only ``query_time`` differs in value (the two
read at different instants), and is compared by format.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpukit.gpus.fake_nvml import load_description
from tests.helpers import MACHINES, ROOT
from tests.helpers.gpustat_driver import described_here, gpustat_text, sleepers

if TYPE_CHECKING:
    from tests.helpers import CliRunner

# datetime.isoformat() of a naive local time: gpustat's query_time (no microseconds when 0).
QUERY_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?")
READABLE = sorted(name for name in (p.stem for p in MACHINES.glob("*.json")) if name != "no-driver")
# A GPU's keys, as gpustat/core.py's new_query builds them, in its order.
GPU_KEYS = [
    *("index", "uuid", "name", "temperature.gpu", "fan.speed", "utilization.gpu"),
    *("utilization.enc", "utilization.dec", "power.draw", "enforced.power.limit"),
    *("memory.used", "memory.total", "processes"),
]
PROCESS_KEYS = [
    *("username", "command", "full_command", "gpu_memory_usage", "cpu_percent"),
    *("cpu_memory_usage", "pid"),
]


def _processes(description: dict[str, Any]) -> list[dict[str, Any]]:
    """Every process entry of a description, those of MIG instances included."""
    found = []
    for gpu in description["gpus"]:
        found += gpu.get("processes", [])
        for mig in gpu.get("mig_devices", []):
            found += mig.get("processes", [])
    return found


def _with_processes_here(description: dict[str, Any], pids: list[int]) -> dict[str, Any]:
    """``description`` with its processes played by ``pids``, real processes of this machine,
    described as they are, so that gpustat (through psutil) sees them too."""
    moved = copy.deepcopy(description)
    entries = _processes(moved)
    assert len(entries) <= len(pids)
    for entry, pid in zip(entries, pids, strict=False):
        entry.update(described_here(pid))
    return moved


def _write(tmp_path: Path, description: dict[str, Any], name: str = "machine") -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(description))
    return path


def _gpukit(run_cli: CliRunner, machine: Path) -> str:
    done = run_cli("list", "--json", "--format", "gpustat", env={"GPUKIT_FAKE_NVML": str(machine)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def _by_pid(gpu: dict[str, Any]) -> dict[str, Any]:
    """A GPU entry with its processes in pid order (gpukit lists them by GPU memory)."""
    if gpu.get("processes") is None:
        return gpu
    return {**gpu, "processes": sorted(gpu["processes"], key=lambda p: p["pid"])}


def _assert_same_document(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The same keys in the same order at every level, the same values of the same JSON types,
    ``query_time`` in the same format."""
    assert list(ours) == list(theirs) == ["hostname", "driver_version", "query_time", "gpus"]
    for doc in (ours, theirs):
        assert QUERY_TIME.fullmatch(doc["query_time"]), doc["query_time"]
        datetime.fromisoformat(doc["query_time"])
    ours_gpus = [_by_pid(g) for g in ours["gpus"]]
    theirs_gpus = [_by_pid(g) for g in theirs["gpus"]]
    assert ours_gpus == theirs_gpus
    assert (ours["hostname"], ours["driver_version"]) == (
        theirs["hostname"],
        theirs["driver_version"],
    )
    # `==` takes 2 for 2.0; the JSON text does not.
    assert json.dumps(ours_gpus) == json.dumps(theirs_gpus)


@pytest.mark.parametrize("name", READABLE)
def test_format_gpustat_prints_what_gpustat_prints_for_every_bundled_machine(
    run_cli: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    described = load_description(name)
    with sleepers([["train.py", "--lr", "3e-4", f"--run={i}"] for i in range(8)]) as pids:
        description = _with_processes_here(described, pids)
        theirs = json.loads(gpustat_text(description, monkeypatch))
        ours = json.loads(_gpukit(run_cli, _write(tmp_path, description)))
    _assert_same_document(ours, theirs)
    assert sum(len(g.get("processes") or []) for g in ours["gpus"]) == len(_processes(described))


def _variant(name: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    description = load_description(name)
    change(description)
    return description


def _older_description(d: dict[str, Any]) -> None:
    for gpu in d["gpus"]:
        for key in ("fan_speed", "utilization_encoder", "utilization_decoder"):
            del gpu[key]


def _old_driver(d: dict[str, Any]) -> None:
    d["unsupported_functions"] = ["nvmlDeviceGetMemoryInfo_v2"]  # reserved counts as used


def _no_process_queries(d: dict[str, Any]) -> None:
    d["unsupported_functions"] = [
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses",
    ]


def _only_graphics_processes(d: dict[str, Any]) -> None:
    d["unsupported_functions"] = ["nvmlDeviceGetComputeRunningProcesses"]


def _odd_readings(d: dict[str, Any]) -> None:
    gpu = d["gpus"][0]
    gpu.update(power_usage_mw=389_999, power_limit_mw=70_001, memory_used=(3 << 20) - 1)
    gpu.update(fan_speed=None, utilization_encoder=None, temperature_c=None)
    gpu["processes"] = [
        {"pid": 1, "used_memory": 0},
        {"pid": 2, "used_memory": None},
        {"pid": 3, "used_memory": (5 << 20) + 1},
    ]


VARIANTS = {
    "description-without-fan-and-codec-readings": ("laptop-rtx3060", _older_description),
    "driver-without-the-v2-memory-query": ("server-4xL4-idle", _old_driver),
    "gpu-that-lists-no-processes": ("kaggle-2xT4-idle", _no_process_queries),
    "gpu-that-lists-graphics-processes-only": ("laptop-rtx3060", _only_graphics_processes),
    "readings-between-units-zero-and-null": ("kaggle-2xT4-idle", _odd_readings),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_format_gpustat_keeps_gpustats_units_and_nulls(
    run_cli: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variant: str
) -> None:
    described = _variant(*VARIANTS[variant])
    with sleepers([["serve.py"]] * 3) as pids:
        description = _with_processes_here(described, pids)
        theirs = json.loads(gpustat_text(description, monkeypatch))
        ours = json.loads(_gpukit(run_cli, _write(tmp_path, description)))
    _assert_same_document(ours, theirs)


def test_format_gpustat_is_laid_out_as_gpustat_prints_it(
    run_cli: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    machine = MACHINES / "server-2xH100-mig.json"
    ours = _gpukit(run_cli, machine)
    theirs = gpustat_text(load_description(machine), monkeypatch)
    # json.dump(indent=4, separators=(",", ": ")) and a line end, in both.
    for text in (ours, theirs):
        assert text == json.dumps(json.loads(text), indent=4, separators=(",", ": ")) + "\n"


def test_format_gpustat_keeps_a_process_gpustat_cannot_find_here_as_described(
    run_cli: CliRunner,
) -> None:
    # The described pids are no processes of this machine (or other ones): gpustat would leave
    # them out; gpukit keeps them with the description's user and command.
    doc = json.loads(_gpukit(run_cli, MACHINES / "server-8xA100-shared.json"))
    first = doc["gpus"][0]["processes"][0]
    assert list(first) == PROCESS_KEYS
    assert first == {
        "username": "alice",
        "command": "python",
        "full_command": ["python", "train.py"],
        "gpu_memory_usage": 76_235_669_504 // (1 << 20),
        "cpu_percent": 0,
        "cpu_memory_usage": 0.0,
        "pid": 40211,
    }


def test_format_gpustat_lists_processes_by_gpu_memory_largest_first(run_cli: CliRunner) -> None:
    doc = json.loads(_gpukit(run_cli, MACHINES / "laptop-rtx3060.json"))
    listed = [(p["pid"], p["gpu_memory_usage"]) for p in doc["gpus"][0]["processes"]]
    assert listed == [(2240, 650117120 >> 20), (1712, 432013312 >> 20)]


# A script written for gpustat's JSON, as users have them: it must run on gpukit unchanged.
GPUSTAT_SCRIPT = """
import json, sys
stats = json.load(sys.stdin)
for gpu in stats["gpus"]:
    users = " ".join(
        f"{p['username']}:{p['command']}({p['gpu_memory_usage']}M)"
        for p in gpu["processes"] or []
    )
    free = gpu["memory.total"] - gpu["memory.used"]
    print(f"[{gpu['index']}] {gpu['name']} | {gpu['temperature.gpu']}C {gpu['utilization.gpu']}% "
          f"{gpu['power.draw']}/{gpu['enforced.power.limit']} W | {free} MB free | {users}")
"""


def test_a_script_written_for_gpustat_runs_unchanged_on_gpukits_output(
    run_cli: CliRunner,
) -> None:
    document = _gpukit(run_cli, MACHINES / "server-8xA100-shared.json")
    done = subprocess.run(
        [sys.executable, "-c", GPUSTAT_SCRIPT],
        input=document,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 8
    assert lines[0] == (
        "[0] NVIDIA A100-SXM4-80GB | 67C 98% 389/400 W | 9012 MB free | alice:python(72704M)"
    )
    assert lines[2] == "[2] NVIDIA A100-SXM4-80GB | 34C 0% 61/400 W | 81511 MB free | "


def test_format_gpustat_needs_neither_gpustat_nor_psutil_installed(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['gpustat'] = sys.modules['psutil'] = None  # as if not installed\n"
        "from gpukit.cli.main import main\n"
        "sys.exit(main(['list', '--json', '--format', 'gpustat']))"
    )
    with sleepers([["train.py"]]) as (pid,):
        description = load_description("kaggle-2xT4-idle")
        description["gpus"][1]["processes"] = [{**described_here(pid), "used_memory": 1 << 30}]
        machine = _write(tmp_path, description)
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "GPUKIT_FAKE_NVML": str(machine)},
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    (process,) = json.loads(done.stdout)["gpus"][1]["processes"]
    assert (process["pid"], process["gpu_memory_usage"]) == (pid, 1024)
    assert process["command"] == os.path.basename(sys.executable)  # read from /proc, as psutil
    assert process["cpu_memory_usage"] > 1 << 20


def test_format_gpustat_without_json_is_a_usage_error(
    run_cli: CliRunner, machines_dir: Path
) -> None:
    env = {"GPUKIT_FAKE_NVML": str(machines_dir / "kaggle-2xT4-idle.json")}
    for args in (("--format", "gpustat"), ("--format", "gpustat", "--watch", "1")):
        done = run_cli("list", *args, env=env, timeout=30)
        assert done.returncode == 2, done.stderr
        assert "--format gpustat chooses what --json prints" in done.stderr
        assert "gpukit list --json --format gpustat" in done.stderr
        assert (done.stdout, "Traceback" in done.stderr) == ("", False)


def test_format_gpustat_refuses_hosts_saying_gpustat_describes_one_machine(
    run_cli: CliRunner,
) -> None:
    done = run_cli("list", "--json", "--format", "gpustat", "--hosts", "gpu1,gpu2", timeout=30)
    assert done.returncode == 2, done.stderr
    assert "describes one machine" in done.stderr
    assert (done.stdout, "Traceback" in done.stderr) == ("", False)


def test_an_unknown_format_is_a_usage_error_naming_the_formats(run_cli: CliRunner) -> None:
    done = run_cli("list", "--json", "--format", "nvitop", timeout=30)
    assert done.returncode == 2
    assert "'gpukit', 'gpustat'" in done.stderr


def test_format_gpustat_without_a_driver_exits_3_as_json_does(
    run_cli: CliRunner, machines_dir: Path
) -> None:
    done = run_cli(
        "list",
        "--json",
        "--format",
        "gpustat",
        env={"GPUKIT_FAKE_NVML": str(machines_dir / "no-driver.json")},
    )
    assert done.returncode == 3
    assert "No NVIDIA driver" in done.stderr
    assert done.stdout == ""


def test_watch_with_format_gpustat_prints_one_gpustat_document_a_line(
    machines_dir: Path,
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "GPUKIT_FAKE_NVML": str(machines_dir / "kaggle-2xT4-idle.json"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "list", "--json", "--format", "gpustat", "--watch", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 30
    while len(lines) < 2 and time.monotonic() < deadline:
        lines.append(proc.stdout.readline())
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    readings = [json.loads(line) for line in lines]
    assert [list(r) for r in readings] == [["hostname", "driver_version", "query_time", "gpus"]] * 2
    assert [list(g) for g in readings[1]["gpus"]] == [GPU_KEYS, GPU_KEYS]
    assert readings[0]["query_time"] < readings[1]["query_time"]
