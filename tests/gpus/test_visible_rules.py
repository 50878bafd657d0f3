"""CUDA_VISIBLE_DEVICES by CUDA's documented rules, on the machines gpukit ships.

Every expected answer is written by hand from the machine descriptions in src/gpukit/gpus/machines
and from the rules CUDA documents: indices, ``GPU-`` and ``MIG-`` UUIDs and unique prefixes of
them; each index read as C's strtoul reads it; the list ends at the first entry that is invalid or
of another kind than the first; a repeated device hides every GPU; indices count fastest first
unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``. Error messages are checked for what was wrong and what
to do next, and for reading as sentences (the command line prints ``message hint`` as one).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import gpukit as gk
import gpukit.gpus.visible as visible
from gpukit.errors import (
    CudaAlreadyInitializedError,
    GpukitError,
    InvalidArgumentError,
    VisibleDevicesError,
)
from gpukit.gpus.grants import granted_gpus
from gpukit.gpus.inventory import GPU, Inventory, inventory
from gpukit.gpus.visible import (
    VisibleDevice,
    VisibleDevices,
    cuda_order,
    parse_visible_devices,
    resolve,
)
from tests.helpers import MACHINES

T4 = "kaggle-2xT4-idle"  # two Tesla T4: GPU-6513270e... (0) and GPU-d23f0824... (1)
A100 = "server-8xA100-shared"  # eight alike A100s, GPU 4 is GPU-a170b338...
MIXED = "workstation-mixed-order"  # GTX 1080 Ti (6.1) at PCI 01, RTX 4090 (8.9) at PCI 02
H100 = "server-2xH100-mig"  # GPU 0 split in two MIG 3g.40gb instances, GPU 1 whole

T4_0 = "GPU-6513270e-269e-0d37-f2a7-4de452e6b438"
T4_1 = "GPU-d23f0824-128b-2f33-0c5c-7fd0a6a3a450"
A100_4 = "GPU-a170b338-3926-3059-f28c-105d1fb17c23"
GTX_1080_TI = "GPU-18f135d2-5f55-7203-3018-50c5a38fd547"
RTX_4090 = "GPU-907a70c3-1012-f037-b64c-e4228c38fb29"
H100_0 = "GPU-6b4cb242-4a23-d596-2217-beaddbc496cb"
MIG_A = "MIG-92276658-1e27-a1c0-8a6a-63ec24ede6a4"
MIG_B = "MIG-ae97ba94-d0ed-a82f-8f6d-05584ef8aa38"
MIG_NAME = "NVIDIA H100 80GB HBM3 MIG 3g.40gb"


UseMachine = Callable[[str], Inventory]


@pytest.fixture
def use(monkeypatch: pytest.MonkeyPatch) -> UseMachine:
    """Switch the fake NVML to a named machine and return its inventory."""

    def switch(name: str) -> Inventory:
        monkeypatch.setenv("GPUKIT_FAKE_NVML", str(MACHINES / f"{name}.json"))
        return inventory()

    return switch


def _reads_as_sentences(error: GpukitError) -> None:
    assert error.message.endswith("."), error.message
    assert error.hint is not None
    assert error.hint[0].isupper(), error.hint
    assert error.hint.endswith("."), error.hint


# -- each index as strtoul reads it -------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("+1", (1,)),  # strtoul takes a leading sign
        ("0-3", (0,)),  # a Slurm-style range is index 0 to CUDA: strtoul stops at the "-"
        ("2+1,0", (2, 0)),
        ("3,1-2", (3, 1)),
    ],
)
def test_an_index_is_read_as_strtoul_reads_it(value: str, expected: tuple[int, ...]) -> None:
    assert parse_visible_devices(value) == expected


# -- what CUDA shows, device by device ----------------------------------------------------------


def test_an_index_names_the_gpu_at_that_place_in_cudas_order_with_its_uuid_and_name(
    use: UseMachine,
) -> None:
    view = resolve("0", None, use(MIXED))
    assert view.devices == (VisibleDevice(0, 1, RTX_4090, "NVIDIA GeForce RTX 4090"),)


def test_a_uuid_prefix_names_the_whole_gpu_with_its_full_uuid_and_name(use: UseMachine) -> None:
    view = resolve("GPU-d23f,GPU-6513270e", "PCI_BUS_ID", use(T4))
    assert view.devices == (
        VisibleDevice(0, 1, T4_1, "Tesla T4"),
        VisibleDevice(1, 0, T4_0, "Tesla T4"),
    )


def test_a_mig_uuid_names_the_instance_with_its_own_name_on_its_parent_gpu(
    use: UseMachine,
) -> None:
    view = resolve(f"{MIG_B},{MIG_A}", None, use(H100))
    assert view.devices == (
        VisibleDevice(0, 0, H100_0, MIG_NAME, MIG_B),
        VisibleDevice(1, 0, H100_0, MIG_NAME, MIG_A),
    )


def test_a_mig_instance_without_a_name_is_shown_with_its_gpus_name() -> None:
    from gpukit.gpus.inventory import MigInstance

    mig = MigInstance(index=0, uuid=MIG_A, name=None, memory_total=None, memory_used=None)
    gpu = GPU(index=0, uuid=H100_0, name="NVIDIA H100 80GB HBM3", mig_instances=(mig,))
    view = resolve(MIG_A[:12], None, Inventory(gpus=(gpu,)))
    assert view.devices == (VisibleDevice(0, 0, H100_0, "NVIDIA H100 80GB HBM3", MIG_A),)


def test_cuda_indices_lists_each_gpus_cuda_numbers(use: UseMachine) -> None:
    # GPU 0 carries both MIG instances, so CUDA's 0 and 1 both run on it.
    assert resolve(f"{MIG_A},{MIG_B}", None, use(H100)).cuda_indices() == {0: [0, 1]}


def test_cuda_indices_maps_nvidia_smi_indices_to_cuda_indices(use: UseMachine) -> None:
    assert resolve("5,2,7", None, use(A100)).cuda_indices() == {5: [0], 2: [1], 7: [2]}
    assert resolve("", None, use(A100)).cuda_indices() == {}
    assert resolve("5,2", None, None).cuda_indices() == {}  # no driver: nothing is known


def test_the_view_as_json_names_the_variables_and_every_device(use: UseMachine) -> None:
    view = resolve("1", "PCI_BUS_ID", use(T4))
    assert json.loads(json.dumps(view.to_json())) == {
        "env": "1",
        "device_order": "PCI_BUS_ID",
        "entries": [1],
        "devices": [
            {
                "cuda_index": 0,
                "nvml_index": 1,
                "uuid": T4_1,
                "name": "Tesla T4",
                "mig_uuid": None,
            }
        ],
        "warnings": [],
    }


def test_the_whole_view_of_a_restricted_process(use: UseMachine) -> None:
    assert resolve("4,2", None, use(A100)) == VisibleDevices(
        env="4,2",
        device_order="FASTEST_FIRST",
        entries=(4, 2),
        devices=(
            VisibleDevice(0, 4, A100_4, "NVIDIA A100-SXM4-80GB"),
            VisibleDevice(
                1, 2, "GPU-8d116ece-1738-f7d9-3d9c-172411e20b8f", "NVIDIA A100-SXM4-80GB"
            ),
        ),
    )


def test_the_device_order_is_cudas_default_fastest_first_when_unset(use: UseMachine) -> None:
    assert resolve(None, None, use(T4)).device_order == "FASTEST_FIRST"
    assert resolve(None, None, None).device_order == "FASTEST_FIRST"
    assert resolve(None, "PCI_BUS_ID", None).device_order == "PCI_BUS_ID"


def test_without_a_driver_the_view_still_gives_the_entries_and_warnings() -> None:
    assert resolve("1,0", None, None) == VisibleDevices("1,0", "FASTEST_FIRST", (1, 0), None, ())
    assert resolve("1,0,x", "PCI_BUS_ID", None) == VisibleDevices(
        "1,0,x",
        "PCI_BUS_ID",
        (1, 0),
        None,
        ("CUDA_VISIBLE_DEVICES=1,0,x: CUDA stops at the first invalid entry and uses only 1,0.",),
    )


def test_visible_devices_reads_the_machine_itself_when_given_none(
    use: UseMachine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    use(A100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a170b338")
    view = gk.visible_devices()
    assert [(d.cuda_index, d.nvml_index, d.uuid) for d in view.devices or ()] == [(0, 4, A100_4)]


# -- warnings: why CUDA may not see what the variable seems to say ------------------------------


def test_an_invalid_entry_warns_which_entries_cuda_still_uses(use: UseMachine) -> None:
    view = resolve("1,0,x,3", None, use(A100))
    assert [d.nvml_index for d in view.devices or ()] == [1, 0]
    assert len(view.warnings) == 1
    assert "CUDA_VISIBLE_DEVICES=1,0,x,3" in view.warnings[0]
    assert "uses only 1,0." in view.warnings[0]


@pytest.mark.parametrize("value", ["1,1", "x,0", "-1"])
def test_a_repeated_or_invalid_first_entry_warns_that_no_gpu_is_seen(
    use: UseMachine,
    value: str,
) -> None:
    view = resolve(value, None, use(A100))
    assert view.devices == ()
    assert len(view.warnings) == 1
    assert f"CUDA_VISIBLE_DEVICES={value} " in view.warnings[0]
    assert "no GPU is seen." in view.warnings[0]


def test_an_empty_variable_hides_every_gpu_without_a_warning(use: UseMachine) -> None:
    view = resolve("", None, use(A100))
    assert (view.entries, view.devices, view.warnings) == ((), (), ())


def test_on_mixed_gpus_the_warning_gives_cudas_likely_numbering_and_the_fix(
    use: UseMachine,
) -> None:
    (warning,) = resolve(None, None, use(MIXED)).warnings
    assert (
        "likely cuda:0=GPU 1 (NVIDIA GeForce RTX 4090), cuda:1=GPU 0 (NVIDIA GeForce GTX 1080 Ti)"
        in warning
    )
    assert warning.endswith("Set CUDA_DEVICE_ORDER=PCI_BUS_ID to make them agree.")


# -- CUDA's order -------------------------------------------------------------------------------


def test_cuda_order_follows_cuda_device_order_from_the_environment(
    use: UseMachine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = use(MIXED)
    assert [g.index for g in cuda_order(inv)] == [1, 0]
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert [g.index for g in cuda_order(inv)] == [0, 1]
    assert [g.index for g in cuda_order(inv, "FASTEST_FIRST")] == [1, 0]  # the argument wins


def test_gpus_whose_pci_bus_id_cannot_be_read_keep_nvidia_smis_order() -> None:
    gpus = (GPU(index=1, uuid=T4_1, name="Tesla T4"), GPU(index=0, uuid=T4_0, name="Tesla T4"))
    assert [g.index for g in cuda_order(Inventory(gpus=gpus), "PCI_BUS_ID")] == [0, 1]
    assert [d.nvml_index for d in resolve("1", "PCI_BUS_ID", Inventory(gpus=gpus)).devices] == [1]


# -- physical_index and its errors --------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "seen"),
    [
        (A100, "4,2", "(cuda:0=GPU 4, cuda:1=GPU 2; CUDA_VISIBLE_DEVICES=4,2)"),
        (T4, None, "(cuda:0=GPU 0, cuda:1=GPU 1; CUDA_VISIBLE_DEVICES is not set)"),
        (T4, "", "(none; CUDA_VISIBLE_DEVICES=)"),
    ],
)
def test_a_cuda_index_not_visible_is_refused_naming_what_the_process_sees(
    use: UseMachine,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    value: str | None,
    seen: str,
) -> None:
    inv = use(name)
    if value is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    with pytest.raises(VisibleDevicesError) as info:
        gk.physical_index(2, inv)
    assert info.value.message.startswith("cuda:2 is not visible")
    assert seen in info.value.message
    assert info.value.hint is not None
    assert "one of those indices" in info.value.hint
    assert "CUDA_VISIBLE_DEVICES before CUDA starts" in info.value.hint
    _reads_as_sentences(info.value)


def test_a_negative_cuda_index_is_not_visible(use: UseMachine) -> None:
    with pytest.raises(VisibleDevicesError, match="cuda:-1 is not visible"):
        gk.physical_index(-1, use(T4))


def test_a_cuda_index_that_is_not_a_whole_number_is_refused_with_an_example(
    use: UseMachine,
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        gk.physical_index("1", use(T4))  # type: ignore[arg-type]
    assert "physical_index('1')" in info.value.message
    assert info.value.hint is not None
    assert "0 for cuda:0" in info.value.hint
    _reads_as_sentences(info.value)


# -- set_visible_devices ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "value"),
    [
        ("2,3", "2,3"),
        (" 2 , 3 ", "2,3"),
        (3, "3"),
        ("", ""),
        ("GPU-6513270e", "GPU-6513270e"),  # the docstring's example: a unique prefix
        (f" {MIG_B} ", MIG_B),
        ([T4_0, T4_1], f"{T4_0},{T4_1}"),  # two UUIDs are entries of one kind
        (["GPU-6513270e", "GPU-d23f0824"], "GPU-6513270e,GPU-d23f0824"),
        ([MIG_A, MIG_B], f"{MIG_A},{MIG_B}"),
    ],
)
def test_set_visible_devices_writes_what_cuda_reads(
    cuda_not_started: None, ids: object, value: str
) -> None:
    assert gk.set_visible_devices(ids) == value  # type: ignore[arg-type]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == value
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_set_visible_devices_refuses_what_is_not_a_gpu_naming_it(cuda_not_started: None) -> None:
    with pytest.raises(VisibleDevicesError) as info:
        gk.set_visible_devices(["cuda:0"])
    assert "'cuda:0'" in info.value.message
    assert info.value.hint is not None
    assert "NVML indices" in info.value.hint
    assert "`gpukit list`" in info.value.hint
    assert "UUIDs" in info.value.hint
    _reads_as_sentences(info.value)


def test_set_visible_devices_refuses_a_device_named_twice(cuda_not_started: None) -> None:
    with pytest.raises(VisibleDevicesError) as info:
        gk.set_visible_devices("1,1")
    assert "CUDA_VISIBLE_DEVICES=1,1" in info.value.message
    assert "twice" in info.value.message
    assert info.value.hint is not None
    assert "each GPU once" in info.value.hint
    _reads_as_sentences(info.value)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


@pytest.mark.parametrize(
    ("ids", "value"),
    [([0, "GPU-abc"], "0,GPU-abc"), ([T4_0, MIG_A], f"{T4_0},{MIG_A}")],
)
def test_set_visible_devices_refuses_entries_of_two_kinds_saying_cuda_would_ignore_some(
    cuda_not_started: None, ids: list[object], value: str
) -> None:
    with pytest.raises(VisibleDevicesError) as info:
        gk.set_visible_devices(ids)
    assert f"CUDA_VISIBLE_DEVICES={value}:" in info.value.message
    assert "ignore part of it" in info.value.message
    assert info.value.hint is not None
    assert "only indices" in info.value.hint
    assert "GPU- UUIDs" in info.value.hint
    assert "MIG- UUIDs" in info.value.hint
    _reads_as_sentences(info.value)


def test_once_cuda_started_the_refusal_names_the_value_cuda_read_and_how_to_start_afresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(visible, "cuda_started", lambda *, by_torch=False: True)
    with pytest.raises(CudaAlreadyInitializedError) as info:
        gk.set_visible_devices([1])
    assert "Cannot set CUDA_VISIBLE_DEVICES=1" in info.value.message
    assert "(with CUDA_VISIBLE_DEVICES=0)" in info.value.message
    assert info.value.hint is not None
    # the README's promise: asking about devices does not start CUDA, is_available() does
    assert "torch.cuda.is_available() is one; gk.device and gk.try_gpu are not" in info.value.hint
    assert "`CUDA_VISIBLE_DEVICES=1 python train.py`" in info.value.hint
    _reads_as_sentences(info.value)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


# -- the probe for a loaded CUDA driver ---------------------------------------------------------

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="RTLD_NOLOAD is Linux's")


def _mapped(library: str) -> bool:
    return library.split(".so")[0] in Path("/proc/self/maps").read_text()


@linux_only
def test_the_driver_probe_finds_a_library_this_process_has_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(visible, "_DRIVER_LIBRARY", "libc.so.6")  # loaded in every process
    assert visible._loaded_cuda_driver() is not None


@linux_only
def test_the_driver_probe_never_loads_the_library_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    candidates = ("expat", "uuid", "zstd", "sqlite3", "bz2")
    name = next(
        (n for n in map(ctypes.util.find_library, candidates) if n and not _mapped(n)), None
    )
    if name is None:
        pytest.skip("no library that this process has not loaded to try the probe on")
    monkeypatch.setattr(visible, "_DRIVER_LIBRARY", name)
    assert visible._loaded_cuda_driver() is None
    assert not _mapped(name)
    ctypes.CDLL(name)
    assert visible._loaded_cuda_driver() is not None


def test_where_libraries_cannot_be_probed_no_driver_counts_as_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(os, "RTLD_NOLOAD", raising=False)  # as on macOS or Windows
    monkeypatch.setattr(visible, "_DRIVER_LIBRARY", "libc.so.6")
    assert visible._loaded_cuda_driver() is None


def test_a_uuid_list_with_an_index_in_it_ends_at_the_index(use: UseMachine) -> None:
    # The list ends at the first entry of another kind than the first: here, at the 0.
    value = f"{T4_0},0,{T4_1}"
    assert parse_visible_devices(value) == (T4_0,)
    view = resolve(value, None, use(T4))
    assert [d.nvml_index for d in view.devices or ()] == [0]
    assert view.warnings == (
        f"CUDA_VISIBLE_DEVICES={value}: CUDA stops at the first invalid entry and uses only "
        f"{T4_0}.",
    )
    grant = granted_gpus(use(T4), {"CUDA_VISIBLE_DEVICES": value})
    assert grant is not None
    assert grant.indices == (0,)


def test_an_index_on_a_machine_with_a_lost_gpu_warns_of_no_numbering_guess(
    use: UseMachine,
) -> None:
    # The lost GPU's model cannot be read; the readable ones are alike, so CUDA's order is PCI's.
    view = resolve("0", None, use("kaggle-2xT4-one-lost"))
    assert [d.nvml_index for d in view.devices or ()] == [0]
    assert view.warnings == ()


def test_indices_on_a_machine_of_mixed_models_warn_that_the_numbering_is_a_guess(
    use: UseMachine,
) -> None:
    view = resolve("0,1", None, use(MIXED))
    [warning] = view.warnings
    assert warning.startswith(
        "CUDA_DEVICE_ORDER is not PCI_BUS_ID and this machine's GPUs differ, so CUDA's "
        "numbering may differ from nvidia-smi's (likely cuda:0=GPU 1 (NVIDIA GeForce RTX 4090)"
    )
    assert warning.endswith("Set CUDA_DEVICE_ORDER=PCI_BUS_ID to make them agree.")
