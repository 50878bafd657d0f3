"""CUDA_VISIBLE_DEVICES at its edges: an index one past the last GPU, CUDA's fastest-first order.

Expected answers come from the machine descriptions and from the documented estimate of CUDA's
default order: highest compute capability first, then most memory, PCI order among equals.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import gpukit as gk
from gpukit.errors import VisibleDevicesError
from gpukit.gpus.inventory import GPU, Inventory, inventory
from gpukit.gpus.visible import resolve


@pytest.fixture(autouse=True)
def _no_cuda_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


def _machine(monkeypatch: pytest.MonkeyPatch, machines_dir: Path, name: str) -> Inventory:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(machines_dir / f"{name}.json"))
    return inventory()


def _gpu(index: int, name: str, cc: tuple[int, int], memory_gib: int) -> GPU:
    return GPU(
        index=index,
        uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000",
        name=name,
        pci_bus_id=f"00000000:{index + 1:02X}:00.0",
        memory_total=memory_gib * 2**30,
        compute_capability=cc,
    )


# -- an index equal to the number of GPUs -------------------------------------------------------


def test_an_index_equal_to_the_gpu_count_is_reported_not_an_index_error(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    inv = _machine(monkeypatch, machines_dir, "kaggle-2xT4-idle")  # GPUs 0 and 1
    view = resolve("2", None, inv)
    assert view.devices == ()
    assert view.warnings == (
        "CUDA_VISIBLE_DEVICES=2: index 2 is not a GPU here (2 GPUs), so CUDA ignores it and "
        "every entry after it.",
    )


def test_an_index_equal_to_the_gpu_count_ends_the_list_after_the_valid_ones(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    inv = _machine(monkeypatch, machines_dir, "kaggle-2xT4-idle")
    view = resolve("1,2,0", None, inv)
    assert [(d.cuda_index, d.nvml_index) for d in view.devices or ()] == [(0, 1)]


def test_physical_index_behind_an_index_equal_to_the_gpu_count_is_a_typed_error(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    inv = _machine(monkeypatch, machines_dir, "kaggle-2xT4-idle")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with pytest.raises(VisibleDevicesError, match="cuda:0 is not visible") as info:
        gk.physical_index(0, inventory=inv)
    assert "sees 0 CUDA devices" in info.value.message
    assert info.value.hint


def test_the_last_gpu_by_index_is_still_visible(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    inv = _machine(monkeypatch, machines_dir, "kaggle-2xT4-idle")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gk.physical_index(0, inventory=inv) == 1


# -- CUDA's default order: compute capability first, then memory --------------------------------


def test_on_the_mixed_workstation_cuda_0_is_the_rtx_4090_nvidia_smi_calls_gpu_1(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    inv = _machine(monkeypatch, machines_dir, "workstation-mixed-order")
    assert [gk.physical_index(i, inventory=inv) for i in (0, 1)] == [1, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gk.physical_index(0, inventory=inv) == 1
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert gk.physical_index(0, inventory=inv) == 0


def test_a_newer_gpu_with_less_memory_comes_first_in_cuda_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # PCI order: an 80 GiB A100 (8.0), then a 24 GiB L4 (8.9). Compute capability decides.
    inv = Inventory(
        gpus=(_gpu(0, "NVIDIA A100-SXM4-80GB", (8, 0), 80), _gpu(1, "NVIDIA L4", (8, 9), 24))
    )
    assert [gk.physical_index(i, inventory=inv) for i in (0, 1)] == [1, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gk.physical_index(0, inventory=inv) == 0


def test_among_gpus_of_one_compute_capability_more_memory_comes_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = Inventory(
        gpus=(
            _gpu(0, "NVIDIA GeForce RTX 3060", (8, 6), 12),
            _gpu(1, "NVIDIA GeForce RTX 3090", (8, 6), 24),
            _gpu(2, "NVIDIA GeForce RTX 3060", (8, 6), 12),
        )
    )
    assert [gk.physical_index(i, inventory=inv) for i in (0, 1, 2)] == [1, 0, 2]
