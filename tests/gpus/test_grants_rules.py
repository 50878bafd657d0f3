"""The GPUs a job was granted, by Slurm's GPU lists and CUDA_VISIBLE_DEVICES, and the refusals.

Expected answers are written by hand from the machine descriptions in src/gpukit/gpus/machines
and from docs/distributed.md: CUDA_VISIBLE_DEVICES decides when set, else SLURM_STEP_GPUS, then
SLURM_JOB_GPUS (comma lists of nvidia-smi indices and ``a-b`` ranges; ``N/A`` or ``none`` where
Slurm gave no GPU); indices on mixed GPUs in CUDA's fastest-first order are refused. Errors are
checked for what was wrong and what to do next, and for reading as sentences.
"""

from __future__ import annotations

import pytest

from gpukit.errors import GpukitError, NoGpuAvailableError, VisibleDevicesError
from gpukit.gpus.grants import Grant, granted_gpus, granted_inventory
from gpukit.gpus.inventory import Inventory, inventory
from tests.helpers import MACHINES


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
