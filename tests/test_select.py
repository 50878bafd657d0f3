"""gk.pick: choosing GPUs by criteria on every described machine, without touching the machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpukit as gk
from gpukit.errors import InvalidArgumentError, NoDriverError, NoGpuAvailableError
from gpukit.gpus.claims import Holder
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.gpus.select import parse_size, pick

ROOT = Path(__file__).resolve().parent.parent
MACHINES = sorted((Path(__file__).parent / "fixtures" / "machines").glob("*.json"))
WITH_DRIVER = [m for m in MACHINES if m.stem != "no-driver"]
A100 = Path(__file__).parent / "fixtures" / "machines" / "server-8xA100-shared.json"
LAPTOP = A100.with_name("laptop-rtx3060.json")
MIG = A100.with_name("server-2xH100-mig.json")
GiB = 2**30

CRITERIA = [
    {},
    {"min_free": "20GiB"},
    {"min_free": "60GiB"},
    {"max_util": 10},
    {"max_processes": 1},
    {"min_free": "4GiB", "max_util": 50, "max_processes": 1},
    {"exclude": [0]},
]


def _machine(monkeypatch: pytest.MonkeyPatch, path: Path) -> Inventory:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(path))
    return inventory()


# What pick() must answer for each machine and criteria (CRITERIA's order): the qualifying GPUs,
# most free memory first, ties by index. Worked out by hand from the fixtures (free = total - used
# - reserved), e.g. on the A100 server: GPUs 2 and 4 have 84.9e9 bytes free and no process,
# 7 has 82.9e9 (1 process, 3% busy), 5 72.4e9 (1, 41%), 3 44.0e9 (1, 0%), 0 and 1 8.9e9 (1, 98%
# and 97%), 6 nothing (1, 100%). A lost GPU and a GPU in MIG mode never qualify.
EXPECTED: dict[str, list[list[int]]] = {
    # one list per CRITERIA entry: {}, 20GiB, 60GiB, util<=10, procs<=1, 4GiB+50%+1 proc, not 0
    "kaggle-2xT4-idle": [[0, 1], [], [], [0, 1], [0, 1], [0, 1], [1]],
    "kaggle-2xT4-one-lost": [[0], [], [], [0], [0], [0], []],
    "laptop-rtx3060": [[], [], [], [], [], [], []],
    "server-2xH100-mig": [[], [1], [1], [], [1], [1], []],
    "server-4xL4-idle": [
        [0, 1, 2, 3],
        [0, 1, 2, 3],
        [],
        [0, 1, 2, 3],
        [0, 1, 2, 3],
        [0, 1, 2, 3],
        [1, 2, 3],
    ],
    "server-8xA100-shared": [
        [2, 4],
        [2, 4, 7, 5, 3],
        [2, 4, 7, 5],
        [2, 4],
        [2, 4, 7, 5, 3, 0, 1, 6],
        [2, 4, 7, 5, 3],
        [2, 4],
    ],
    "workstation-mixed-order": [[1, 0], [1], [], [1, 0], [1, 0], [1, 0], [1]],
}


def test_every_machine_with_a_driver_has_hand_written_expected_picks() -> None:
    assert sorted(EXPECTED) == sorted(m.stem for m in WITH_DRIVER)
    assert all(len(row) == len(CRITERIA) for row in EXPECTED.values())


@pytest.mark.parametrize("which", range(len(CRITERIA)), ids=lambda i: repr(CRITERIA[i]))
@pytest.mark.parametrize("machine", WITH_DRIVER, ids=lambda p: p.stem)
def test_pick_returns_only_qualifying_gpus_most_free_first_or_explains_every_rejection(
    monkeypatch: pytest.MonkeyPatch, machine: Path, which: int
) -> None:
    inv = _machine(monkeypatch, machine)
    criteria = CRITERIA[which]
    expected = EXPECTED[machine.stem][which]
    rejected = [g.index for g in inv.gpus if g.index not in expected]
    for n in range(1, len(inv.gpus) + 2):
        if n > len(expected):
            with pytest.raises(NoGpuAvailableError) as info:
                pick(n, inventory=inv, claims={}, **criteria)  # type: ignore[arg-type]
            assert all(f"GPU {i}: " in info.value.message for i in rejected)
            assert not any(f"GPU {i}: " in info.value.message for i in expected)
            continue
        chosen = pick(n, inventory=inv, claims={}, **criteria)  # type: ignore[arg-type]
        assert [g.index for g in chosen] == expected[:n]


def test_pick_without_criteria_takes_only_idle_gpus_of_a_shared_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100)
    assert [g.index for g in pick(2, inventory=inv, claims={})] == [2, 4]


def test_pick_counts_a_gpu_whose_memory_is_held_at_zero_utilisation_as_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100)
    bob = inv.gpu(3)
    assert bob.utilization_gpu == 0
    assert bob.processes
    with pytest.raises(NoGpuAvailableError) as info:
        pick(3, inventory=inv, claims={})
    assert "GPU 3: 1 process (bob, jupyter-kernel)" in info.value.message


def test_pick_explains_a_memory_rejection_with_the_gpu_users(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100)
    with pytest.raises(NoGpuAvailableError) as info:
        pick(5, min_free="60GiB", inventory=inv, claims={})
    free = (inv.gpu(3).memory_free or 0) / GiB
    expected = f"GPU 3: {free:.1f} GiB free < 60 GiB; 1 process (bob, jupyter-kernel)"
    assert expected in info.value.message
    assert info.value.exit_code == 4


def test_pick_with_min_free_shares_a_gpu_whose_memory_suffices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100)
    chosen = pick(5, min_free="30GiB", inventory=inv, claims={})
    assert [g.index for g in chosen] == [2, 4, 7, 5, 3]  # erin's, carol's, bob's GPUs shared


def test_pick_skips_gpus_claimed_by_other_gpukit_users_before_they_allocate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100)
    holder = Holder("zoe", 4242, "host", "python train.py", 0.0)
    chosen = pick(1, inventory=inv, claims={inv.gpu(2).uuid: holder})
    assert [g.index for g in chosen] == [4]
    with pytest.raises(NoGpuAvailableError) as info:
        pick(2, inventory=inv, claims={inv.gpu(2).uuid: holder})
    assert "GPU 2: claimed by zoe (pid 4242: python train.py)" in info.value.message


def test_pick_excludes_gpus_by_index_and_by_uuid_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    inv = _machine(monkeypatch, A100)
    assert [g.index for g in pick(1, exclude=[2], inventory=inv, claims={})] == [4]
    prefix = inv.gpu(4).uuid[:12]
    assert [
        g.index for g in pick(1, exclude=[2, prefix], min_free=1, inventory=inv, claims={})
    ] == [7]


@pytest.mark.parametrize("one", [2, "2", "GPU-8d116ece"], ids=repr)
def test_pick_excludes_one_gpu_given_on_its_own(
    monkeypatch: pytest.MonkeyPatch, one: int | str
) -> None:
    inv = _machine(monkeypatch, A100)  # GPU-8d116ece... is GPU 2, the idle GPU with most free
    picked = pick(1, exclude=one, inventory=inv, claims={})  # type: ignore[arg-type]
    assert [g.index for g in picked] == [4]


def test_pick_never_chooses_a_gpu_in_mig_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    inv = _machine(monkeypatch, MIG)
    assert [g.index for g in pick(1, min_free="1GiB", inventory=inv, claims={})] == [1]
    with pytest.raises(NoGpuAvailableError) as info:
        pick(2, min_free="1GiB", inventory=inv, claims={})
    assert "GPU 0: in MIG mode" in info.value.message


def test_pick_on_a_desktop_gpu_says_how_to_share_it(monkeypatch: pytest.MonkeyPatch) -> None:
    inv = _machine(monkeypatch, LAPTOP)
    with pytest.raises(NoGpuAvailableError) as info:
        pick(1, inventory=inv, claims={})
    assert "--max-processes" in str(info.value)
    assert [g.index for g in pick(1, max_processes=2, inventory=inv, claims={})] == [0]


def test_pick_of_more_gpus_than_exist_says_how_many_there_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100.with_name("kaggle-2xT4-idle.json"))
    with pytest.raises(NoGpuAvailableError, match="this machine has 2"):
        pick(3, inventory=inv, claims={})


def test_pick_by_index_order_keeps_nvidia_smi_order(monkeypatch: pytest.MonkeyPatch) -> None:
    inv = _machine(monkeypatch, A100.with_name("workstation-mixed-order.json"))
    assert [g.index for g in pick(2, inventory=inv, claims={})] == [1, 0]  # more free first
    assert [g.index for g in pick(2, order="index", inventory=inv, claims={})] == [0, 1]


def test_pick_reads_the_machine_when_given_no_inventory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(A100))
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(tmp_path))
    assert [g.index for g in gk.pick(2)] == [2, 4]


def test_pick_without_a_driver_raises_no_driver(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(A100.with_name("no-driver.json")))
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(tmp_path))
    with pytest.raises(NoDriverError):
        gk.pick()


@pytest.mark.parametrize(
    "bad",
    [
        {"n": 0},
        {"n": "2"},
        {"n": 2.0},
        {"max_util": 120},
        {"max_processes": -1},
        {"min_free": "lots"},
        {"order": "x"},
    ],
    ids=repr,
)
def test_pick_rejects_criteria_that_make_no_sense(
    monkeypatch: pytest.MonkeyPatch, bad: dict[str, object]
) -> None:
    inv = _machine(monkeypatch, A100)
    with pytest.raises(InvalidArgumentError):
        pick(inventory=inv, claims={}, **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 * GiB), ("500MB", 500_000_000), ("1.5G", int(1.5 * GiB)), ("512 MiB", 512 * 2**20)],
)
def test_parse_size_reads_decimal_and_binary_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@given(st.integers(min_value=0, max_value=2**50), st.sampled_from(["", "B", "KiB", "MiB", "GiB"]))
def test_parse_size_is_exact_for_whole_numbers_of_any_binary_unit(number: int, unit: str) -> None:
    factor = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert parse_size(f"{number}{unit}") == number * factor


def test_selection_and_the_commands_never_import_torch() -> None:
    code = (
        "import sys; import gpukit, gpukit.gpus.select, gpukit.gpus.claims, gpukit.gpus.waiting, "
        "gpukit.cli.pick, gpukit.cli.run; gpukit.pick; gpukit.claim; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_pick_skips_a_lost_gpu_and_says_why(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(machines_dir / "kaggle-2xT4-one-lost.json"))
    assert [g.index for g in gk.pick(1)] == [0]
    with pytest.raises(NoGpuAvailableError, match=r"GPU 1: unreadable by NVML \(GPU is lost\)"):
        gk.pick(2)


@pytest.mark.parametrize(
    ("criteria", "says"),
    [
        ({"min_free": float("nan")}, "nan is not a memory size"),
        ({"min_free": float("inf")}, "inf is not a memory size"),
        ({"min_free": "9" * 400}, "is more memory than any GPU has"),
        ({"min_free": 2**101}, "is more memory than any GPU has"),
        ({"min_free": "²GiB"}, "Cannot read '²GiB' as a memory size"),
        ({"min_free": [8]}, "[8] is not a memory size"),
        ({"max_util": float("nan")}, "max_util=nan is not a percentage"),
        ({"max_util": "10"}, "max_util=10 is not a percentage"),
        ({"max_util": True}, "max_util=True is not a percentage"),
    ],
)
def test_pick_refuses_criteria_that_are_not_numbers_with_a_typed_error(
    criteria: dict[str, object], says: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        gk.pick(1, claims={}, **criteria)  # type: ignore[arg-type]
    assert says in caught.value.message


def test_a_size_of_four_hundred_digits_is_read_exactly_not_as_infinity() -> None:
    assert parse_size("1" + "0" * 29) == 10**29
    assert parse_size("1.5GiB") == 3 * 2**29


def test_pick_never_takes_an_excluded_gpu_even_the_best_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100)  # idle: GPUs 2 and 4, equally free
    assert [g.index for g in pick(1, inventory=inv, claims={}, exclude=[2])] == [4]
    with pytest.raises(NoGpuAvailableError):
        pick(2, inventory=inv, claims={}, exclude=[2])
