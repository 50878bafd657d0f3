"""Choosing only among the GPUs granted to this process: CUDA_VISIBLE_DEVICES, then Slurm's."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpukit as gk
from gpukit.errors import NoGpuAvailableError, VisibleDevicesError
from gpukit.gpus.grants import granted_gpus, granted_inventory
from gpukit.gpus.inventory import Inventory
from tests.helpers import MACHINES

A100 = "server-8xA100-shared"  # 8 alike GPUs; only 2 and 4 idle
MIXED = "workstation-mixed-order"  # a GTX 1080 Ti at PCI 01, an RTX 4090 at PCI 02
UUID_5 = "GPU-0fd630f1-f29d-0da9-953f-48f1a09f76b5"


def _machine(monkeypatch: pytest.MonkeyPatch, name: str) -> Inventory:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(MACHINES / f"{name}.json"))
    return gk.inventory()


@pytest.mark.parametrize(
    ("env", "indices"),
    [
        ({"CUDA_VISIBLE_DEVICES": "4"}, (4,)),
        ({"CUDA_VISIBLE_DEVICES": "5,2"}, (5, 2)),
        ({"CUDA_VISIBLE_DEVICES": UUID_5}, (5,)),
        ({"CUDA_VISIBLE_DEVICES": "GPU-0fd630f1"}, (5,)),  # a unique prefix, as CUDA takes it
        ({"CUDA_VISIBLE_DEVICES": "4,x,5"}, (4,)),  # CUDA stops at the first invalid entry
        ({"CUDA_VISIBLE_DEVICES": ""}, ()),
        ({"SLURM_JOB_GPUS": "4,5"}, (4, 5)),
        ({"SLURM_JOB_GPUS": "0-3", "SLURM_STEP_GPUS": "2,3"}, (2, 3)),
        ({"CUDA_VISIBLE_DEVICES": "7", "SLURM_JOB_GPUS": "6,7"}, (7,)),
    ],
)
def test_granted_gpus_map_each_entry_to_the_nvml_gpu_it_names(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], indices: tuple[int, ...]
) -> None:
    grant = granted_gpus(_machine(monkeypatch, A100), env)
    assert grant is not None
    assert grant.indices == indices


def test_nothing_set_grants_every_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert granted_gpus(_machine(monkeypatch, A100), {}) is None


def test_indices_on_mixed_gpus_in_cudas_own_order_are_refused_with_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, MIXED)
    with pytest.raises(VisibleDevicesError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID") as info:
        granted_gpus(inv, {"CUDA_VISIBLE_DEVICES": "0"})
    assert "UUID" in info.value.hint


def test_indices_on_mixed_gpus_count_in_pci_order_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, MIXED)
    env = {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    grant = granted_gpus(inv, env)
    assert grant is not None
    assert grant.indices == (1,)
    uuid = inv.gpus[0].uuid
    by_uuid = granted_gpus(inv, {"CUDA_VISIBLE_DEVICES": uuid})  # UUIDs need no order
    assert by_uuid is not None
    assert by_uuid.indices == (0,)


def test_a_slurm_gpu_the_machine_does_not_have_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(VisibleDevicesError, match="SLURM_JOB_GPUS=8,9 names GPU 8, 9"):
        granted_gpus(_machine(monkeypatch, A100), {"SLURM_JOB_GPUS": "8,9"})


def test_asking_for_more_gpus_than_granted_says_which_variable_granted_which(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100)
    with pytest.raises(NoGpuAvailableError) as info:
        granted_inventory(inv, 2, {"CUDA_VISIBLE_DEVICES": "4"})
    assert "CUDA_VISIBLE_DEVICES=4 grants this process 1 (GPU 4)" in info.value.message
    assert "--all-gpus" in info.value.hint


def test_gk_pick_chooses_among_the_granted_gpus_unless_all_gpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _machine(monkeypatch, A100)
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    assert [g.index for g in gk.pick(1, order="index")] == [4]
    assert [g.index for g in gk.pick(1, order="index", all_gpus=True)] == [2]
    with pytest.raises(NoGpuAvailableError, match="grants this process 2"):
        gk.pick(3)


def test_gk_pick_under_a_grant_still_refuses_a_count_that_is_not_a_number(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _machine(monkeypatch, A100)
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    with pytest.raises(gk.InvalidArgumentError, match="Cannot pick '1' GPUs"):
        gk.pick("1")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["srun-gpus-per-task-indices", "srun-gpus-per-task-uuids"])
def test_a_task_bound_to_its_gpu_by_slurm_chooses_that_gpu_only(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    from tests.distributed.test_environment import fixture

    inv = _machine(monkeypatch, A100)
    grant = granted_gpus(inv, fixture(name))  # CUDA_VISIBLE_DEVICES wins over SLURM_STEP_GPUS
    assert grant is not None
    assert (grant.variable, grant.indices) == ("CUDA_VISIBLE_DEVICES", (5,))
