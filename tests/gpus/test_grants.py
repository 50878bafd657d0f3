"""The GPUs granted to this process (CUDA_VISIBLE_DEVICES, then Slurm's lists), and the refusals.

Expected answers are written by hand from the machine descriptions in src/gpukit/gpus/machines
and from docs/distributed.md: CUDA_VISIBLE_DEVICES decides when set, else SLURM_STEP_GPUS, then
SLURM_JOB_GPUS (comma lists of nvidia-smi indices and ``a-b`` ranges; ``N/A`` or ``none`` where
Slurm gave no GPU); indices on mixed GPUs in CUDA's fastest-first order are refused. Errors are
checked for what was wrong and what to do next, and for reading as sentences.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import gpukit as gk
from gpukit.errors import GpukitError, NoGpuAvailableError, VisibleDevicesError
from gpukit.gpus.grants import Grant, granted_gpus, granted_inventory
from gpukit.gpus.inventory import Inventory, inventory
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


# -- The rules, case by case -------------------------------------------------------------------


@pytest.fixture
def a100(monkeypatch: pytest.MonkeyPatch) -> Inventory:
    """Eight alike A100s, nvidia-smi's 0 to 7."""
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(MACHINES / "server-8xA100-shared.json"))
    return inventory()


@pytest.fixture
def mixed(monkeypatch: pytest.MonkeyPatch) -> Inventory:
    """A GTX 1080 Ti (nvidia-smi's 0) and an RTX 4090 (1): CUDA counts the 4090 first."""
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(MACHINES / "workstation-mixed-order.json"))
    return inventory()


def _reads_as_sentences(error: GpukitError) -> None:
    assert error.message.endswith("."), error.message
    assert error.hint is not None
    assert error.hint[0].isupper(), error.hint
    assert error.hint.endswith("."), error.hint


# -- Slurm's lists ------------------------------------------------------------------------------


def test_a_slurm_grant_names_its_variable_and_value(a100: Inventory) -> None:
    grant = granted_gpus(a100, {"SLURM_JOB_GPUS": "2-3,6"})
    assert grant == Grant((2, 3, 6), "SLURM_JOB_GPUS", "2-3,6")
    assert grant.describe() == "SLURM_JOB_GPUS=2-3,6"


@pytest.mark.parametrize("no_gpu", ["N/A", "n/a", "none", "NONE", " None "])
def test_a_step_without_gpus_falls_back_to_the_jobs_gpus(a100: Inventory, no_gpu: str) -> None:
    env = {"SLURM_STEP_GPUS": no_gpu, "SLURM_JOB_GPUS": "4,5"}
    assert granted_gpus(a100, env) == Grant((4, 5), "SLURM_JOB_GPUS", "4,5")


@pytest.mark.parametrize("no_gpu", ["N/A", "none", ""])
def test_a_job_without_gpus_restricts_nothing(a100: Inventory, no_gpu: str) -> None:
    assert granted_gpus(a100, {"SLURM_JOB_GPUS": no_gpu}) is None


@pytest.mark.parametrize("raw", ["gpu:2", "0,,1", "3-", "0;1"])
def test_a_slurm_value_that_is_not_a_list_of_indices_is_refused_with_what_to_do(
    a100: Inventory, raw: str
) -> None:
    with pytest.raises(VisibleDevicesError) as info:
        granted_gpus(a100, {"SLURM_STEP_GPUS": raw})
    assert f"SLURM_STEP_GPUS={raw} is not a list of GPU indices" in info.value.message
    assert info.value.hint is not None
    assert "Unset SLURM_STEP_GPUS" in info.value.hint
    assert "--all-gpus" in info.value.hint
    _reads_as_sentences(info.value)


def test_a_slurm_gpu_nvml_does_not_show_is_refused_listing_those_it_shows(
    a100: Inventory,
) -> None:
    with pytest.raises(VisibleDevicesError) as info:
        granted_gpus(a100, {"SLURM_JOB_GPUS": "6-9"})
    message = info.value.message
    assert message.startswith("SLURM_JOB_GPUS=6-9 names GPU 8, 9,")
    assert "(it shows 0, 1, 2, 3, 4, 5, 6, 7)" in message
    hint = info.value.hint
    assert hint is not None
    assert "gres.conf" in hint  # why Slurm's numbers can differ from nvidia-smi's
    assert "differs from nvidia-smi" in hint
    assert "set CUDA_VISIBLE_DEVICES to the job's GPU UUIDs" in hint
    assert "--all-gpus" in hint
    _reads_as_sentences(info.value)


def test_a_slurm_gpu_on_a_node_where_nvml_shows_none_says_so() -> None:
    with pytest.raises(VisibleDevicesError) as info:
        granted_gpus(Inventory(gpus=()), {"SLURM_JOB_GPUS": "0"})
    assert "names GPU 0" in info.value.message
    assert "(it shows none)" in info.value.message


# -- CUDA_VISIBLE_DEVICES on mixed GPUs ---------------------------------------------------------


def test_indices_on_mixed_gpus_are_refused_naming_the_models_and_the_ways_out(
    mixed: Inventory,
) -> None:
    with pytest.raises(VisibleDevicesError) as info:
        granted_gpus(mixed, {"CUDA_VISIBLE_DEVICES": "0"})
    message = info.value.message
    assert message.startswith("CUDA_VISIBLE_DEVICES=0 counts GPUs in CUDA's fastest-first order")
    assert "(NVIDIA GeForce GTX 1080 Ti, NVIDIA GeForce RTX 4090)" in message
    assert "cannot be known for sure" in message
    hint = info.value.hint
    assert hint is not None
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in hint
    assert "list the GPUs by UUID (`gpukit list`)" in hint
    assert "--all-gpus" in hint
    _reads_as_sentences(info.value)


# -- asking for more than the grant -------------------------------------------------------------


def test_asking_for_exactly_the_granted_gpus_gives_them(a100: Inventory) -> None:
    granted = granted_inventory(a100, 2, {"CUDA_VISIBLE_DEVICES": "4,2"})
    assert [g.index for g in granted.gpus] == [2, 4]


@pytest.mark.parametrize(
    ("n", "value", "said"),
    [
        (1, "", "Asked for 1 GPU: CUDA_VISIBLE_DEVICES= grants this process 0 "),
        (3, "4,5", "Asked for 3 GPUs: CUDA_VISIBLE_DEVICES=4,5 grants this process 2 "),
        (2, "", "Asked for 2 GPUs: CUDA_VISIBLE_DEVICES= grants this process 0 "),
    ],
)
def test_asking_for_more_than_granted_says_how_many_of_which(
    a100: Inventory, n: int, value: str, said: str
) -> None:
    with pytest.raises(NoGpuAvailableError) as info:
        granted_inventory(a100, n, {"CUDA_VISIBLE_DEVICES": value})
    message = info.value.message
    assert message.startswith(said)
    which = "(GPU 4, GPU 5)" if value else "(none of this machine's GPUs)"
    assert message.endswith(f"{which}.")
    hint = info.value.hint
    assert hint is not None
    assert "--all-gpus (all_gpus=True)" in hint
    _reads_as_sentences(info.value)
