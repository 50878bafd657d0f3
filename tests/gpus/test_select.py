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
from gpukit.errors import (
    InvalidArgumentError,
    NoDriverError,
    NoGpuAvailableError,
    UserLimitError,
)
from gpukit.gpus.criteria import Criteria
from gpukit.gpus.inventory import GPU, GpuProcess, Inventory, inventory
from gpukit.gpus.select import assess, best_first, choose, no_gpu_error
from gpukit.holders import Holder, user_name
from gpukit.sharing.pick import check_user_limit, pick
from gpukit.sharing.policy import Limits, Policy
from gpukit.sizes import format_size, parse_size
from tests.helpers import MACHINES, ROOT

DESCRIPTIONS = sorted(MACHINES.glob("*.json"))
WITH_DRIVER = [m for m in DESCRIPTIONS if m.stem != "no-driver"]
A100 = MACHINES / "server-8xA100-shared.json"
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
    free = format_size(inv.gpu(3).memory_free or 0)
    expected = f"GPU 3: {free} free < 60 GiB; 1 process (bob, jupyter-kernel)"
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
        "import sys; import gpukit, gpukit.gpus.select, gpukit.sharing.claims, "
        "gpukit.sharing.tickets, gpukit.sharing.pick, "
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


# -- what the user reads and the edges of each rule, with answers worked out by hand ------------

_SIZE_HINT = 'Write a number of bytes or a size with a unit, e.g. "8GiB", "500MB".'


def _gpu(
    index: int,
    *,
    free: int | None = 80 * GiB,
    util: int | None = 0,
    processes: tuple[tuple[str | None, str | None], ...] = (),
    total: int | None = 80 * GiB,
    mig: bool | None = False,
    error: str | None = None,
) -> GPU:
    return GPU(
        index=index,
        uuid=f"GPU-{index:04d}aaaa",
        name="test GPU",
        memory_total=total,
        memory_free=free,
        utilization_gpu=util,
        mig_mode=mig,
        processes=tuple(
            GpuProcess(pid=100 + i, user=user, command=command, used_memory=GiB)
            for i, (user, command) in enumerate(processes)
        ),
        error=error,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1),
        ("1b", 1),
        ("1kb", 1000),
        ("1KB", 1000),
        ("1mb", 1_000_000),
        ("1tb", 10**12),
        ("1k", 1024),
        ("1KiB", 1024),
        ("1m", 2**20),
        ("1g", 2**30),
        ("1t", 2**40),
        ("1TiB", 2**40),
        (" 2 GiB ", 2 * 2**30),
        ("1.", 1),
        (".5KiB", 512),
    ],
)
def test_parse_size_reads_every_unit_it_documents(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "True is not a memory size."),
        (None, "None is not a memory size."),
        (float("inf"), "inf is not a memory size."),
        ("8 GiBs", "Cannot read '8 GiBs' as a memory size."),
        ("-1GiB", "Cannot read '-1GiB' as a memory size."),
        (-1, "A memory size cannot be negative (-1)."),
        (-0.5, "A memory size cannot be negative (-0.5)."),
        ("x" * 22, f"Cannot read '{'x' * 22}' as a memory size."),
        ("x" * 23, f"Cannot read '{'x' * 19}... (25 characters) as a memory size."),
    ],
    ids=repr,
)
def test_a_size_that_cannot_be_read_is_refused_saying_what_was_given_and_how_to_write_one(
    value: object, message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_size(value)  # type: ignore[arg-type]
    assert caught.value.message == message
    assert caught.value.hint == _SIZE_HINT


def test_sizes_up_to_2_to_the_100_bytes_are_read_and_larger_ones_refused() -> None:
    assert parse_size(2**100) == 2**100
    assert parse_size(0) == 0
    assert parse_size(1.9) == 1
    with pytest.raises(InvalidArgumentError) as caught:
        parse_size(2**100 + 1)
    assert caught.value.message == (
        "12676506002282294014... (31 characters) is more memory than any GPU has (gpukit "
        "refuses sizes past 2**100 bytes)."
    )
    assert caught.value.hint == 'Write a size a GPU can have, e.g. "80GiB".'


def test_criteria_are_described_in_the_words_of_the_refusal() -> None:
    assert Criteria.make().describe() == "no process on it"
    assert Criteria.make(min_free="1.5GiB", max_util=10).describe() == (
        "at least 1.5 GiB free, at most 10% busy"
    )
    assert Criteria.make(min_free="60GiB", max_processes=2, exclude=[0, "GPU-8d11"]).describe() == (
        "at least 60 GiB free, at most 2 process(es), not 0, GPU-8d11"
    )
    assert Criteria.make(min_free=0, max_processes=0).describe() == (
        "at least 0 B free, no process on it"
    )
    assert Criteria.make(max_util=10.9).max_util == 10  # a fraction of a percent never loosens


@pytest.mark.parametrize(
    ("criteria", "message", "hint"),
    [
        ({"max_util": 101}, "max_util=101 is not a percentage.", "Use a value from 0 to 100."),
        ({"max_util": -1}, "max_util=-1 is not a percentage.", "Use a value from 0 to 100."),
        ({"max_processes": -1}, "max_processes=-1 is negative.", "Use 0 or more."),
        (
            {"exclude": [1.5]},
            "Cannot exclude 1.5: not an NVML index or a UUID.",
            "Exclude GPUs by their `gpukit list` index or GPU- UUID.",
        ),
        (
            {"exclude": [True]},
            "Cannot exclude True: not an NVML index or a UUID.",
            "Exclude GPUs by their `gpukit list` index or GPU- UUID.",
        ),
    ],
    ids=repr,
)
def test_criteria_out_of_range_are_refused_saying_what_to_use(
    criteria: dict[str, object], message: str, hint: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        Criteria.make(**criteria)  # type: ignore[arg-type]
    assert (caught.value.message, caught.value.hint) == (message, hint)


def test_exclude_given_as_a_comma_separated_string_names_each_gpu() -> None:
    assert Criteria.make(exclude="2, 4,,").exclude == ("2", "4")
    assert Criteria.make(exclude=3).exclude == (3,)  # type: ignore[arg-type]
    assert Criteria.make(exclude=[]).exclude == ()


def test_an_exclude_naming_no_gpu_or_several_is_refused_naming_the_machines_gpus() -> None:
    inv = Inventory(gpus=(_gpu(0), _gpu(1)))
    hint = (
        "Exclude GPUs by their `gpukit list` index or their UUID (a prefix is enough when it "
        "names one GPU)."
    )
    with pytest.raises(InvalidArgumentError) as caught:
        pick(1, exclude=[5], inventory=inv, claims={})
    assert caught.value.message == (
        "Cannot exclude 5: it names no GPU of this machine. The machine has GPUs "
        "0 (GPU-0000aaaa), 1 (GPU-0001aaaa)."
    )
    assert caught.value.hint == hint
    with pytest.raises(InvalidArgumentError) as caught:
        pick(1, exclude=["GPU-000"], inventory=inv, claims={})
    assert caught.value.message == (
        "Cannot exclude 'GPU-000': it is a prefix of the UUIDs of GPUs 0, 1. The machine has "
        "GPUs 0 (GPU-0000aaaa), 1 (GPU-0001aaaa)."
    )
    with pytest.raises(InvalidArgumentError, match="Cannot exclude 9: it names no GPU"):
        pick(1, exclude=[0, 9], inventory=inv, claims={})  # every entry is checked, not the first
    with pytest.raises(InvalidArgumentError, match=r"The machine has GPUs none\."):
        Criteria.make(exclude=[0]).check_exclude(Inventory(gpus=()))
    with pytest.raises(InvalidArgumentError, match="names no GPU"):
        Criteria.make(exclude=[""]).check_exclude(inv)  # "" is no prefix of a UUID


def test_each_rejection_states_the_reading_and_the_limit_it_broke() -> None:
    gpus = (
        _gpu(0, free=GiB + GiB // 2, util=50, processes=(("ann", "python a.py"),)),
        _gpu(1, free=None, util=None),
        _gpu(2, mig=True),
        _gpu(3, error="GPU is lost"),
        _gpu(4, free=-5, util=101, processes=(("bob", "b"), ("cid", "c"))),
        _gpu(5, processes=((None, "x" * 40), ("bob", None), ("cid", "c"), ("dan", "d"))),
        _gpu(6, free=2 * GiB, util=10, processes=(("eve", "e"),)),
        _gpu(7, processes=(("ann", "a"), ("bob", "b"), ("cid", "c"))),
    )
    criteria = Criteria.make(min_free="2GiB", max_util=10, max_processes=1, exclude=[5])
    claimed = Holder("zoe", 42, "host", "python z.py", 0.0)
    verdicts = assess(Inventory(gpus=gpus), criteria, {"GPU-0004aaaa": claimed})
    assert [v.explain() for v in verdicts] == [
        "GPU 0: 1.5 GiB free < 2 GiB; 50% busy > 10%; 1 process (ann, python a.py)",
        "GPU 1: free memory unknown",
        "GPU 2: in MIG mode (use one of its MIG instances by UUID in CUDA_VISIBLE_DEVICES)",
        "GPU 3: unreadable by NVML (GPU is lost)",
        "GPU 4: claimed by zoe (pid 42: python z.py); 0 B free < 2 GiB; 101% busy > 10%; "
        "2 processes (bob, b; cid, c) > 1",
        "GPU 5: excluded; 4 processes (?, " + "x" * 30 + "; bob, ?; cid, c; ...)",
        "GPU 6: qualifies; 1 process (eve, e)",
        "GPU 7: 3 processes (ann, a; bob, b; cid, c) > 1",
    ]
    assert [v.ok for v in verdicts] == [False] * 6 + [True, False]
    assert verdicts[4].claimed_by == claimed
    assert verdicts[0].claimed_by is None


def test_only_a_gpu_that_could_ever_qualify_is_worth_waiting_for() -> None:
    criteria = Criteria.make(min_free="40GiB", exclude=[2])
    assert criteria.could_ever_qualify(_gpu(0, free=0, total=40 * GiB))
    assert criteria.could_ever_qualify(_gpu(1, free=0, total=None))
    assert not criteria.could_ever_qualify(_gpu(0, total=40 * GiB - 1))
    assert not criteria.could_ever_qualify(_gpu(2))
    assert not criteria.could_ever_qualify(_gpu(0, mig=True))
    assert not criteria.could_ever_qualify(_gpu(0, error="GPU is lost"))
    assert Criteria.make().could_ever_qualify(_gpu(0, total=0))


def test_the_refusal_says_what_was_asked_how_many_qualify_and_why_each_other_gpu_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A100 free memory (total - used - reserved): GPUs 0 and 1 8.3 GiB, 3 41.0 GiB, 5 67.4 GiB,
    # 6 below zero; 2, 4 and 7 (77.2 GiB, 3 % busy) qualify.
    inv = _machine(monkeypatch, A100)
    with pytest.raises(NoGpuAvailableError) as caught:
        pick(4, min_free="60GiB", max_util=10, inventory=inv, claims={})
    assert caught.value.message == (
        "Asked for 4 GPUs with at least 60 GiB free, at most 10% busy: 3 of 8 qualify.\n"
        "  GPU 0: 8.3 GiB free < 60 GiB; 98% busy > 10%; 1 process (alice, python train.py)\n"
        "  GPU 1: 8.3 GiB free < 60 GiB; 97% busy > 10%; 1 process (alice, python train.py)\n"
        "  GPU 3: 41 GiB free < 60 GiB; 1 process (bob, jupyter-kernel)\n"
        "  GPU 5: 41% busy > 10%; 1 process (carol, python serve.py)\n"
        "  GPU 6: 0 B free < 60 GiB; 100% busy > 10%; 1 process (dave, torchrun worker)"
    )
    assert caught.value.hint == "Wait for them with `gpukit run --wait`, or relax the criteria."


def test_the_refusal_of_one_gpu_says_one_qualifies_or_none_and_when_waiting_cannot_help(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100)
    with pytest.raises(NoGpuAvailableError) as caught:
        pick(1, min_free="81GiB", inventory=inv, claims={})
    assert caught.value.message.startswith("Asked for 1 GPU with at least 81 GiB free: 0 of 8 ")
    assert "qualify.\n  GPU 0: 8.3 GiB free < 81 GiB; 1 process" in caught.value.message
    assert (
        caught.value.hint == "Waiting cannot help: only 0 could ever qualify; relax the criteria."
    )
    with pytest.raises(NoGpuAvailableError) as caught:
        pick(3, min_free="77GiB", exclude=[2], inventory=inv, claims={})
    assert caught.value.message.startswith(
        "Asked for 3 GPUs with at least 77 GiB free, not 2: 2 of 8 qualify."
    )
    with pytest.raises(NoGpuAvailableError) as caught:
        pick(2, min_free="78GiB", exclude=[2], inventory=inv, claims={})
    assert caught.value.message.startswith(
        "Asked for 2 GPUs with at least 78 GiB free, not 2: 1 of 8 qualifies."
    )
    # 7 GPUs are not excluded and have 80 GiB in all: waiting could free 2 of them
    assert caught.value.hint == "Wait for them with `gpukit run --wait`, or relax the criteria."


def test_the_refusal_on_a_shared_gpu_says_how_to_share_it_and_counts_what_could_qualify(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, LAPTOP)
    with pytest.raises(NoGpuAvailableError) as caught:
        pick(1, inventory=inv, claims={})
    assert caught.value.message.startswith("Asked for 1 GPU with no process on it: 0 of 1 ")
    assert caught.value.hint == (
        "Wait for them with `gpukit run --wait`, or relax the criteria (--min-free SIZE or "
        "--max-processes N shares a GPU with its processes)."
    )
    with pytest.raises(NoGpuAvailableError) as caught:
        pick(1, max_processes=1, inventory=inv, claims={})
    assert caught.value.hint == "Wait for them with `gpukit run --wait`, or relax the criteria."


def test_asking_for_more_gpus_than_the_machine_has_says_how_many_it_has() -> None:
    inv = Inventory(gpus=(_gpu(0), _gpu(1, processes=(("ann", "a"),))))
    with pytest.raises(NoGpuAvailableError) as caught:
        pick(3, inventory=inv, claims={})
    assert caught.value.message == (
        "Asked for 3 GPUs with no process on it: this machine has 2.\n  GPU 1: 1 process (ann, a)"
    )
    assert caught.value.hint == "Ask for at most 2."
    with pytest.raises(NoGpuAvailableError) as caught:
        pick(1, inventory=Inventory(gpus=()), claims={})
    assert caught.value.message == (
        "Asked for 1 GPU with no process on it: the driver reports no GPU on this machine."
    )
    assert caught.value.hint == "Check `nvidia-smi`."
    assert no_gpu_error(inv, 1, Criteria(max_processes=3, min_free=0), []).message == (
        "Asked for 1 GPU with at least 0 B free, at most 3 process(es): 0 of 2 qualify."
    )


def test_pick_orders_by_least_busy_then_fewest_processes_then_most_free_then_index() -> None:
    inv = Inventory(
        gpus=(
            _gpu(0, util=5),
            _gpu(1, util=0, processes=(("ann", "a"),)),
            _gpu(2, util=0, free=10 * GiB),
            _gpu(3, util=0, free=20 * GiB),
            _gpu(4, util=0, free=20 * GiB),
            _gpu(5, util=None, free=None, processes=(("ann", "a"), ("bob", "b"))),
        )
    )
    every = {"max_processes": 2, "inventory": inv, "claims": {}}
    assert [g.index for g in pick(6, order="util", **every)] == [3, 4, 2, 1, 5, 0]  # type: ignore[arg-type]
    assert [g.index for g in pick(6, order="free", **every)] == [0, 1, 3, 4, 2, 5]  # type: ignore[arg-type]
    assert [g.index for g in pick(6, order="index", **every)] == [0, 1, 2, 3, 4, 5]  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, -1, 1.0, True, "1"], ids=repr)
def test_pick_of_a_number_of_gpus_that_is_not_a_positive_int_is_refused(n: object) -> None:
    inv = Inventory(gpus=(_gpu(0),))
    with pytest.raises(InvalidArgumentError) as caught:
        pick(n, inventory=inv, claims={})  # type: ignore[arg-type]
    assert (caught.value.message, caught.value.hint) == (
        f"Cannot pick {n!r} GPUs.",
        "Ask for 1 or more, as an int.",
    )
    with pytest.raises(InvalidArgumentError) as caught:
        pick(1, order="most", inventory=inv, claims={})  # type: ignore[arg-type]
    assert (caught.value.message, caught.value.hint) == (
        "order='most' is not an order gpukit knows.",
        "Use one of ('free', 'index', 'util').",
    )


def test_pick_refuses_more_gpus_than_the_users_limit_and_says_whether_waiting_helps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(tmp_path))
    policy = Policy(Limits(max_gpus_per_user=1), path=tmp_path / "policy.toml")
    check_user_limit(1, policy)  # holds none: one more is within the limit
    check_user_limit(5, Policy())  # no policy: no limit
    with pytest.raises(UserLimitError) as caught:
        check_user_limit(2, policy)
    assert caught.value.message == (
        f"Asked for 2 GPUs, but the policy {tmp_path / 'policy.toml'} allows 1 per user "
        f"(max_gpus_per_user) and {user_name(os.getuid())} already holds none."
    )
    assert caught.value.hint == "Waiting cannot help: ask for fewer GPUs, or ask the administrator."
    inv = _machine(monkeypatch, A100)
    with gk.claim([inv.gpu(2)]), pytest.raises(UserLimitError) as caught:
        check_user_limit(1, policy)
    assert caught.value.hint == (
        "Release a claim, ask for fewer GPUs, or wait for your own claims to end with "
        "`gpukit run --wait`."
    )


def test_a_gpu_whose_readings_are_unknown_ranks_as_idle_and_empty_ties_broken_by_index() -> None:
    unknown_util, idle = _gpu(0, util=None), _gpu(1, util=0)
    assert [g.index for g in best_first([idle, unknown_util], "util")] == [0, 1]
    empty, unknown_free = _gpu(0, free=0), _gpu(1, free=None)
    assert [g.index for g in best_first([unknown_free, empty], "util")] == [0, 1]
    assert [g.index for g in best_first([unknown_free, empty], "free")] == [0, 1]
    assert [g.index for g in best_first([unknown_free, empty, _gpu(2, free=1)])] == [2, 0, 1]
    # 1 % busy ranks after idle, one byte more free memory ranks first
    assert [g.index for g in best_first([_gpu(0, util=1), _gpu(1, util=0)], "util")] == [1, 0]
    assert [g.index for g in best_first([_gpu(0, free=0), _gpu(1, free=1)], "util")] == [1, 0]
    inv = Inventory(gpus=(_gpu(0, free=GiB), _gpu(1, free=2 * GiB)))
    assert [g.index for g in choose(inv, 2, Criteria.make(), claims={})] == [1, 0]


@pytest.fixture
def shared_a100(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The A100 server read through the fake NVML, with an empty lock folder of this user's."""
    for granted in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        monkeypatch.delenv(granted, raising=False)
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(A100))
    locks = tmp_path / "locks"
    locks.mkdir()
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(locks))
    return locks


def test_pick_reading_the_machine_keeps_the_order_asked_for(shared_a100: Path) -> None:
    # 30 GiB free: 2 and 4 (79.1 GiB), 7 (77.2), 5 (67.4), 3 (41.0)
    assert [g.index for g in gk.pick(3, min_free="30GiB")] == [2, 4, 7]
    assert [g.index for g in gk.pick(3, min_free="30GiB", order="index")] == [2, 3, 4]


def test_pick_reading_the_machine_chooses_only_among_the_granted_gpus_unless_all_gpus(
    monkeypatch: pytest.MonkeyPatch, shared_a100: Path
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    assert [g.index for g in gk.pick(1, min_free="30GiB")] == [4]
    assert [g.index for g in gk.pick(1, min_free="30GiB", order="index")] == [3]
    assert [g.index for g in gk.pick(1, min_free="30GiB", all_gpus=True, order="index")] == [2]
    with pytest.raises(NoGpuAvailableError) as caught:
        gk.pick(3, min_free="30GiB")
    assert "grants this process 2 (GPU 3, GPU 4)" in caught.value.message


def test_pick_reading_the_machine_applies_the_administrators_user_limit(shared_a100: Path) -> None:
    policy = shared_a100 / "policy.toml"
    policy.write_text("[limits]\nmax_gpus_per_user = 1\n")
    policy.chmod(0o644)
    assert [g.index for g in gk.pick(1)] == [2]
    with pytest.raises(UserLimitError, match="Asked for 2 GPUs, but the policy"):
        gk.pick(2)
