"""CUDA_VISIBLE_DEVICES parsing, logical-to-physical mapping, and setting it safely."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gpukit as gk
from gpukit.errors import CudaAlreadyInitializedError, NoDriverError, VisibleDevicesError
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.gpus.visible import cuda_order, parse_visible_devices, resolve
from tests.helpers import ROOT, needs_gpus

UseMachine = Callable[[str], Inventory]


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch, machines_dir: Path) -> UseMachine:
    """Switch the fake NVML to a named machine and return its inventory."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)

    def use(name: str) -> Inventory:
        monkeypatch.setenv("GPUKIT_FAKE_NVML", str(machines_dir / f"{name}.json"))
        return inventory()

    return use


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", ()),
        ("0,1", (0, 1)),
        (" 2 , 0", (2, 0)),
        ("1gpu,3", (1, 3)),
        ("0,-1,2", (0,)),
        ("0,x,2", (0,)),
        ("1,1", ()),
        ("GPU-abc,GPU-def", ("GPU-abc", "GPU-def")),
        ("GPU-abc,0", ("GPU-abc",)),
        ("MIG-abc", ("MIG-abc",)),
    ],
)
def test_parse_reads_the_variable_as_cuda_does(
    value: str | None, expected: tuple[int | str, ...] | None
) -> None:
    assert parse_visible_devices(value) == expected


@given(st.lists(st.integers(min_value=0, max_value=20), max_size=8))
def test_parse_of_distinct_indices_keeps_them_in_order(indices: list[int]) -> None:
    distinct = list(dict.fromkeys(indices))
    assert parse_visible_devices(",".join(map(str, distinct))) == tuple(distinct)


@given(st.lists(st.sampled_from(["0", "1", "2", "3", "-1", "x", "GPU-a", " 4"]), min_size=1))
def test_parse_result_is_a_prefix_of_the_entries_or_empty(items: list[str]) -> None:
    parsed = parse_visible_devices(",".join(items))
    assert parsed is not None
    assert len(set(parsed)) == len(parsed)
    assert len(parsed) <= len(items)


def test_unset_variable_shows_every_gpu_in_pci_order_when_gpus_are_alike(
    machine: UseMachine,
) -> None:
    inv = machine("kaggle-2xT4-idle")
    view = gk.visible_devices(inv)
    assert not view.restricted
    assert [(d.cuda_index, d.nvml_index) for d in view.devices] == [(0, 0), (1, 1)]
    assert view.warnings == ()


def test_mixed_gpus_warn_that_cuda_order_may_differ_from_nvidia_smi(machine: UseMachine) -> None:
    view = gk.visible_devices(machine("workstation-mixed-order"))
    assert any("CUDA_DEVICE_ORDER" in w and "PCI_BUS_ID" in w for w in view.warnings)


def test_estimated_fastest_first_order_matches_the_recorded_cuda_order(
    machine: UseMachine, machines_dir: Path
) -> None:
    import json

    recorded = json.loads((machines_dir / "workstation-mixed-order.json").read_text())
    inv = machine("workstation-mixed-order")
    assert [g.index for g in cuda_order(inv, "FASTEST_FIRST")] == recorded[
        "cuda_fastest_first_order"
    ]


def test_pci_bus_id_order_makes_cuda_index_equal_nvml_index(
    machine: UseMachine, monkeypatch: pytest.MonkeyPatch
) -> None:
    inv = machine("workstation-mixed-order")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert [gk.physical_index(i, inv) for i in (0, 1)] == [0, 1]
    assert gk.visible_devices(inv).warnings == ()


def test_physical_index_follows_fastest_first_when_order_is_unset(
    machine: UseMachine, monkeypatch: pytest.MonkeyPatch
) -> None:
    inv = machine("workstation-mixed-order")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gk.physical_index(0, inv) == 1  # CUDA's 0 is the RTX 4090, nvidia-smi's 1


def test_visible_list_maps_logical_indices_in_listed_order(
    machine: UseMachine, monkeypatch: pytest.MonkeyPatch
) -> None:
    inv = machine("server-8xA100-shared")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,2")
    assert [gk.physical_index(i, inv) for i in (0, 1)] == [4, 2]


def test_abbreviated_gpu_uuid_selects_that_gpu(
    machine: UseMachine, monkeypatch: pytest.MonkeyPatch
) -> None:
    inv = machine("server-8xA100-shared")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a170b338")
    assert gk.physical_index(0, inv) == 4


def test_mig_uuid_maps_to_its_parent_gpu(
    machine: UseMachine, monkeypatch: pytest.MonkeyPatch
) -> None:
    inv = machine("server-2xH100-mig")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-ae97ba94-d0ed-a82f-8f6d-05584ef8aa38")
    view = gk.visible_devices(inv)
    assert view.devices[0].mig_uuid == "MIG-ae97ba94-d0ed-a82f-8f6d-05584ef8aa38"
    assert gk.physical_index(0, inv) == 0


def test_an_index_beyond_the_gpus_cuts_the_list_short_with_a_warning(machine: UseMachine) -> None:
    view = resolve("1,7,0", "PCI_BUS_ID", machine("kaggle-2xT4-idle"))
    assert [d.nvml_index for d in view.devices] == [1]
    assert any("7" in w and "ignores it" in w for w in view.warnings)


def test_an_ambiguous_uuid_prefix_cuts_the_list_short(machine: UseMachine) -> None:
    view = resolve("GPU-", "PCI_BUS_ID", machine("kaggle-2xT4-idle"))
    assert view.devices == ()


def test_empty_variable_means_no_gpu(machine: UseMachine, monkeypatch: pytest.MonkeyPatch) -> None:
    inv = machine("kaggle-2xT4-idle")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gk.visible_devices(inv).devices == ()
    with pytest.raises(VisibleDevicesError, match="sees 0 CUDA devices"):
        gk.physical_index(0, inv)


def test_two_entries_naming_one_gpu_hide_every_gpu(machine: UseMachine) -> None:
    view = resolve("GPU-6513,GPU-6513270e", "PCI_BUS_ID", machine("kaggle-2xT4-idle"))
    assert view.devices == ()
    assert any("twice" in w for w in view.warnings)


def test_visible_devices_without_a_driver_still_parses(
    machine: UseMachine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(NoDriverError):
        machine("no-driver")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    view = gk.visible_devices()
    assert view.entries == (1, 0)
    assert view.devices is None
    with pytest.raises(NoDriverError):
        gk.physical_index(0)


def test_set_visible_devices_sets_the_variable_and_pci_order(
    monkeypatch: pytest.MonkeyPatch,
    cuda_not_started: None,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert gk.set_visible_devices([2, "3"]) == "2,3"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_set_visible_devices_accepts_gpus_from_the_inventory(
    machine: UseMachine, monkeypatch: pytest.MonkeyPatch, cuda_not_started: None
) -> None:
    inv = machine("kaggle-2xT4-idle")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gk.set_visible_devices([inv.gpus[1]]) == inv.gpus[1].uuid


def test_set_visible_devices_with_an_empty_list_hides_every_gpu(
    monkeypatch: pytest.MonkeyPatch,
    cuda_not_started: None,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gk.set_visible_devices([]) == ""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("ids", [[0, 0], [0, "GPU-abc"], [-1], ["cuda:0"], [True]])
def test_set_visible_devices_refuses_what_cuda_would_misread(
    monkeypatch: pytest.MonkeyPatch, ids: list[object]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(VisibleDevicesError):
        gk.set_visible_devices(ids)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"


def test_set_visible_devices_raises_once_cuda_has_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(CudaAlreadyInitializedError, match="already started"):
        gk.set_visible_devices([1])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


def test_set_visible_devices_to_the_current_value_is_allowed_after_cuda_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert gk.set_visible_devices([1]) == "1"


def test_visible_and_inventory_never_import_torch() -> None:
    code = (
        "import sys, gpukit.gpus.visible, gpukit.gpus.inventory, gpukit.errors;"
        "gpukit.gpus.visible.set_visible_devices([0]);"
        "print('torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("index", ["0", 1.0, True])
def test_physical_index_refuses_what_is_not_a_cuda_index(index: object) -> None:
    from gpukit.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="whole number"):
        gk.physical_index(index)  # type: ignore[arg-type]


class _FakeDriver:
    """libcuda as ctypes shows it: cuDeviceGetCount answers as the driver would."""

    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.calls = 0

    def cuDeviceGetCount(self, _count: object) -> int:
        self.calls += 1
        return self.answer


def test_set_visible_devices_raises_when_the_driver_was_started_outside_torch_is_initialized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch.cuda.is_available() runs cuInit while torch.cuda.is_initialized() stays False.
    import gpukit.gpus.visible as visible

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    driver = _FakeDriver(answer=0)  # CUDA_SUCCESS: cuInit has run
    monkeypatch.setattr(visible, "_loaded_cuda_driver", lambda: driver)
    with pytest.raises(CudaAlreadyInitializedError, match=r"torch\.cuda\.is_available"):
        gk.set_visible_devices([1])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert driver.calls == 1


def test_set_visible_devices_raises_when_cuinit_failed_as_the_variable_was_read_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gpukit.gpus.visible as visible

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    no_device = 100  # CUDA_ERROR_NO_DEVICE, what cuInit met with CUDA_VISIBLE_DEVICES=""
    monkeypatch.setattr(visible, "_loaded_cuda_driver", lambda: _FakeDriver(no_device))
    with pytest.raises(CudaAlreadyInitializedError):
        gk.set_visible_devices([0])


def test_set_visible_devices_works_while_the_loaded_driver_is_not_initialised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gpukit.gpus.visible as visible

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    not_initialized = 3  # CUDA_ERROR_NOT_INITIALIZED: loaded, cuInit never called
    monkeypatch.setattr(visible, "_loaded_cuda_driver", lambda: _FakeDriver(not_initialized))
    assert gk.set_visible_devices([1]) == "1"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_driver_probe_finds_a_loaded_library_and_never_loads_one_itself() -> None:
    # libcuda is not on this machine, so the probe is tried on another library that exists.
    code = (
        "import ctypes, ctypes.util, gpukit.gpus.visible as v\n"
        "name = next((n for n in map(ctypes.util.find_library, ('uuid', 'zstd', 'sqlite3'))\n"
        "             if n and n.split('.so')[0] not in open('/proc/self/maps').read()), None)\n"
        "if name is None:\n"
        "    print('none'); raise SystemExit\n"
        "v._DRIVER_LIBRARY = name\n"
        "before = v._loaded_cuda_driver()\n"
        "loaded = name.split('.so')[0] in open('/proc/self/maps').read()\n"
        "ctypes.CDLL(name)\n"
        "print(before is None, loaded, v._loaded_cuda_driver() is not None)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    if out.stdout.strip() == "none":
        pytest.skip("no library to try the probe on")
    assert out.stdout.split() == ["True", "False", "True"]


@needs_gpus(1)
def test_visible_devices_set_after_asking_about_devices_is_the_device_cuda_uses() -> None:
    # The promise of the README, on a real GPU: gk.device("auto") and friends do not start the
    # driver, so the device CUDA shows afterwards is the one asked for (in another process).
    code = (
        "import torch, pynvml, gpukit as gk\n"
        "gk.device('auto'); gk.try_gpu(0); gk.try_all_gpus()\n"
        "pynvml.nvmlInit()\n"
        "last = pynvml.nvmlDeviceGetCount() - 1\n"
        "want = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(last))\n"
        "gk.set_visible_devices([last])\n"
        "seen = str(torch.cuda.get_device_properties(0).uuid)\n"
        "print(want.removeprefix('GPU-') == seen, torch.cuda.device_count())\n"
        "try:\n"
        "    gk.set_visible_devices([0, last] if last else ['GPU-0'])\n"
        "except gk.CudaAlreadyInitializedError:\n"
        "    print('refused')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.split() == ["True", "1", "refused"]


@needs_gpus(1)
def test_torch_is_available_makes_set_visible_devices_refuse() -> None:
    code = (
        "import torch, gpukit as gk\n"
        "torch.cuda.is_available()\n"
        "print(torch.cuda.is_initialized())\n"
        "try:\n"
        "    gk.set_visible_devices([0])\n"
        "except gk.CudaAlreadyInitializedError:\n"
        "    print('refused')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.split() == ["False", "refused"]
