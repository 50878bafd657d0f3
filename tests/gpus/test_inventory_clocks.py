"""The SM and memory clocks: read from NVML (nvmlDeviceGetClockInfo), optional in descriptions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpukit.gpus.fake_nvml import check_description
from gpukit.gpus.inventory import Inventory, inventory
from tests.helpers import MACHINES

# Machines whose every GPU NVML reads in full (the lost GPU of one-lost reads nothing).
WITH_DRIVER = [
    m
    for m in sorted(MACHINES.glob("*.json"))
    if m.stem not in ("no-driver", "kaggle-2xT4-one-lost")
]


def _use(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, data: dict[str, Any]) -> None:
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(path))


@pytest.mark.parametrize("machine", WITH_DRIVER, ids=lambda p: p.stem)
def test_inventory_reads_each_gpus_sm_and_memory_clock(
    monkeypatch: pytest.MonkeyPatch, machine: Path
) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(machine))
    described = json.loads(machine.read_text())
    assert [(g.clock_sm_mhz, g.clock_mem_mhz) for g in inventory().gpus] == [
        (g["clock_sm_mhz"], g["clock_mem_mhz"]) for g in described["gpus"]
    ]


def test_a_busy_h100_clocks_higher_than_an_idle_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", "server-2xH100-mig")
    idle, busy = inventory().gpus
    assert (idle.clock_sm_mhz, idle.clock_mem_mhz) == (345, 2619)
    assert (busy.clock_sm_mhz, busy.clock_mem_mhz) == (1980, 2619)


def test_a_description_without_clocks_still_loads_and_reads_them_as_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data = json.loads((MACHINES / "kaggle-2xT4-idle.json").read_text())
    for gpu in data["gpus"]:  # as descriptions were written before clocks were read
        del gpu["clock_sm_mhz"], gpu["clock_mem_mhz"]
    assert check_description(data) == []
    _use(monkeypatch, tmp_path, data)
    inv = inventory()
    assert [(g.clock_sm_mhz, g.clock_mem_mhz) for g in inv.gpus] == [(None, None)] * 2
    assert [g.temperature_c for g in inv.gpus] == [54, 50]


def test_a_driver_without_the_clock_query_reads_clocks_as_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data = json.loads((MACHINES / "kaggle-2xT4-idle.json").read_text())
    data["unsupported_functions"] = ["nvmlDeviceGetClockInfo"]
    _use(monkeypatch, tmp_path, data)
    gpu = inventory().gpus[0]
    assert (gpu.clock_sm_mhz, gpu.clock_mem_mhz) == (None, None)
    assert gpu.memory_total == 16106127360


def test_one_clock_not_supported_leaves_the_other(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data = json.loads((MACHINES / "kaggle-2xT4-idle.json").read_text())
    data["gpus"][1]["clock_mem_mhz"] = None
    _use(monkeypatch, tmp_path, data)
    gpu = inventory().gpus[1]
    assert (gpu.clock_sm_mhz, gpu.clock_mem_mhz) == (300, None)


def test_clocks_survive_the_inventory_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", "server-8xA100-shared")
    inv = inventory()
    again = Inventory.from_json(json.dumps(inv.to_json()))
    assert [(g.clock_sm_mhz, g.clock_mem_mhz) for g in again.gpus][:3] == [
        (1410, 1593),
        (1410, 1593),
        (210, 1593),
    ]


def test_an_inventory_json_from_before_clocks_reads_them_as_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", "kaggle-2xT4-idle")
    data = inventory().to_json()
    for gpu in data["gpus"]:
        del gpu["clock_sm_mhz"], gpu["clock_mem_mhz"]
    assert [g.clock_sm_mhz for g in Inventory.from_json(data).gpus] == [None, None]


@pytest.mark.parametrize("value", ["1410", -1, 1.5, True])
def test_a_clock_that_is_not_whole_mhz_is_named_in_the_description_check(value: Any) -> None:
    problems = check_description({"gpus": [{"clock_sm_mhz": value}]})
    assert [p.split(" is ")[0] for p in problems] == ["gpus[0].clock_sm_mhz"]
