"""gk.pick at the edges users rely on: claims of other jobs, exact limits, decimal and binary units.

Every expected answer is worked out by hand from the machine descriptions in
src/gpukit/gpus/machines (free memory = total - used - reserved, as NVML's v2 query reports it).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpukit as gk
from gpukit.errors import InvalidArgumentError, NoGpuAvailableError
from gpukit.gpus.criteria import Criteria
from gpukit.gpus.inventory import GPU, Inventory, inventory
from gpukit.sharing.pick import pick
from gpukit.sizes import parse_size
from tests.helpers import MACHINES, CliRunner, subprocess_env

A100 = MACHINES / "server-8xA100-shared.json"
LAPTOP = MACHINES / "laptop-rtx3060.json"

# The laptop's only GPU: 6442450944 total - 1034551296 used - 0 reserved; two processes on it.
LAPTOP_FREE = 5_407_899_648
# A100 GPUs 2 and 4 (idle): 85899345920 total - 429496729 used - 536870912 reserved.
A100_IDLE_FREE = 84_932_978_279


def _machine(monkeypatch: pytest.MonkeyPatch, path: Path) -> Inventory:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(path))
    return inventory()


def _indices(gpus: list[GPU]) -> list[int]:
    return [g.index for g in gpus]


# -- claims made by other jobs ------------------------------------------------------------------

# Claims GPU 2 of the A100 server, says so, and holds it until its stdin closes.
_OTHER_JOB = """
import sys
import gpukit as gk
inv = gk.inventory()
with gk.claim([inv.gpu(2)], command="python other_job.py"):
    print("claimed", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def other_job_holds_gpu_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Another process, sharing this lock folder, has claimed A100 GPU 2 and still runs."""
    for granted in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        monkeypatch.delenv(granted, raising=False)  # every GPU of the machine may be picked
    lock_dir = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(lock_dir))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(A100))
    env = subprocess_env(
        GPUKIT_LOCK_DIR=str(lock_dir), GPUKIT_FAKE_NVML=str(A100), CUDA_VISIBLE_DEVICES=None
    )
    job = subprocess.Popen(
        [sys.executable, "-c", _OTHER_JOB],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert job.stdout is not None
    assert job.stdin is not None
    try:
        line = job.stdout.readline()  # blocks until the claim is held (or the job died)
        assert line == "claimed\n", job.stderr.read() if job.stderr else line
        yield
    finally:
        job.stdin.close()
        job.wait(timeout=60)
        if job.stdout:
            job.stdout.close()
        if job.stderr:
            job.stderr.close()


@pytest.mark.usefixtures("other_job_holds_gpu_2")
def test_pick_leaves_a_gpu_another_running_job_has_claimed() -> None:
    # Idle GPUs 2 and 4 tie on free memory; 2 would come first, but the other job holds it.
    assert _indices(gk.pick()) == [4]


@pytest.mark.usefixtures("other_job_holds_gpu_2")
def test_pick_of_two_idle_gpus_fails_while_another_job_holds_one_and_names_it() -> None:
    with pytest.raises(NoGpuAvailableError) as info:
        gk.pick(2)
    assert "GPU 2: claimed by " in info.value.message
    assert "python other_job.py" in info.value.message


def test_pick_leaves_a_gpu_this_process_has_claimed_for_an_earlier_job(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(tmp_path))
    inv = _machine(monkeypatch, A100)
    with gk.claim([inv.gpu(2)], command="first job"):
        assert _indices(gk.pick()) == [4]  # 2 would come first (same free memory, lower index)
    assert _indices(gk.pick(2)) == [2, 4]  # released: both idle GPUs again


# -- min_free: a GPU with exactly that much free qualifies --------------------------------------


def test_min_free_equal_to_a_gpus_free_memory_qualifies(monkeypatch: pytest.MonkeyPatch) -> None:
    inv = _machine(monkeypatch, LAPTOP)
    assert _indices(pick(1, min_free=LAPTOP_FREE, inventory=inv, claims={})) == [0]


def test_min_free_one_byte_above_a_gpus_free_memory_rejects_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, LAPTOP)
    with pytest.raises(NoGpuAvailableError, match=r"GPU 0: 5\.0 GiB free < 5\.0 GiB"):
        pick(1, min_free=LAPTOP_FREE + 1, inventory=inv, claims={})


def test_min_free_equal_to_the_free_memory_of_two_idle_gpus_takes_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100)
    assert _indices(pick(2, min_free=A100_IDLE_FREE, inventory=inv, claims={})) == [2, 4]
    with pytest.raises(NoGpuAvailableError):
        pick(1, min_free=A100_IDLE_FREE + 1, inventory=inv, claims={})


# -- max_util: a percentage, 100 included, a GPU exactly at the limit qualifies ------------------


def test_max_util_100_is_accepted_and_lets_a_fully_busy_gpu_qualify(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100)
    # Every A100 has at most one process; GPU 6 runs at 100 %.
    chosen = pick(8, max_util=100, max_processes=1, order="index", inventory=inv, claims={})
    assert _indices(chosen) == [0, 1, 2, 3, 4, 5, 6, 7]


def test_max_util_equal_to_a_gpus_utilisation_qualifies_and_one_below_rejects_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100)
    # Utilisation: GPU 0 98 %, GPU 1 97 %, GPU 6 100 %, the others 41 % or less.
    at_98 = pick(7, max_util=98, max_processes=1, order="index", inventory=inv, claims={})
    assert _indices(at_98) == [0, 1, 2, 3, 4, 5, 7]
    at_97 = pick(6, max_util=97, max_processes=1, order="index", inventory=inv, claims={})
    assert _indices(at_97) == [1, 2, 3, 4, 5, 7]


@pytest.mark.parametrize("util", [0, 100])
def test_criteria_accept_both_ends_of_the_percentage_range(util: int) -> None:
    assert Criteria.make(max_util=util).max_util == util


@pytest.mark.parametrize("util", [-1, 101, 100.5])
def test_criteria_refuse_a_utilisation_outside_0_to_100(util: float) -> None:
    with pytest.raises(InvalidArgumentError, match="not a percentage") as info:
        Criteria.make(max_util=util)
    assert info.value.exit_code == 2


# -- max_processes: 0 means idle GPUs only, even when sharing by memory --------------------------


def test_max_processes_0_takes_only_gpus_no_process_holds_even_with_min_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, A100)
    # With min_free alone, GPUs 7, 5 and 3 (one process each) would be shared.
    chosen = pick(2, min_free="1GiB", max_processes=0, inventory=inv, claims={})
    assert _indices(chosen) == [2, 4]
    with pytest.raises(NoGpuAvailableError) as info:
        pick(3, min_free="1GiB", max_processes=0, inventory=inv, claims={})
    assert "GPU 7: 1 process (erin, python eval.py)" in info.value.message


def test_max_processes_equal_to_a_gpus_process_count_qualifies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = _machine(monkeypatch, LAPTOP)  # Xorg and firefox hold memory on it
    assert _indices(pick(1, max_processes=2, inventory=inv, claims={})) == [0]
    with pytest.raises(NoGpuAvailableError, match=r"GPU 0: 2 processes \(.*\) > 1"):
        pick(1, max_processes=1, inventory=inv, claims={})
    with pytest.raises(NoGpuAvailableError, match="GPU 0: 2 processes"):
        pick(1, max_processes=0, inventory=inv, claims={})


def test_max_processes_0_is_a_limit_not_a_mistake() -> None:
    criteria = Criteria.make(min_free="1GiB", max_processes=0)
    assert criteria.process_limit == 0
    assert "no process on it" in criteria.describe()


# -- sizes: GB is 10**9 bytes, GiB is 2**30 -----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1KB", 1_000),
        ("1MB", 1_000_000),
        ("8GB", 8_000_000_000),
        ("8gb", 8_000_000_000),
        ("2TB", 2_000_000_000_000),
        ("1KiB", 1_024),
        ("1MiB", 1_048_576),
        ("8GiB", 8_589_934_592),
        ("2TiB", 2_199_023_255_552),
        ("8G", 8_589_934_592),
        ("1.5GB", 1_500_000_000),
    ],
)
def test_sizes_in_gb_are_powers_of_1000_and_in_gib_powers_of_1024(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_min_free_in_gb_is_read_as_decimal_gigabytes(monkeypatch: pytest.MonkeyPatch) -> None:
    inv = _machine(monkeypatch, A100)
    # The idle GPUs have 84932978279 bytes free: more than 80 GB (8e10), less than 80 GiB.
    assert _indices(pick(2, min_free="80GB", inventory=inv, claims={})) == [2, 4]
    with pytest.raises(NoGpuAvailableError, match=r"GPU 2: 79\.1 GiB free < 80 GiB"):
        pick(1, min_free="80GiB", inventory=inv, claims={})


# -- the same edges through `gpukit pick` ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "code", "stdout"),
    [
        (
            ["-n", "8", "--max-util", "100", "--max-processes", "1", "--order", "index"],
            0,
            "0,1,2,3,4,5,6,7\n",
        ),
        (["-n", "2", "--min-free", "84932978279B"], 0, "2,4\n"),
        (["--min-free", "84932978280B"], 4, ""),
        (["-n", "2", "--min-free", "80GB"], 0, "2,4\n"),
        (["--min-free", "80GiB"], 4, ""),
        (["-n", "3", "--min-free", "1GiB", "--max-processes", "0"], 4, ""),
        (["--max-util", "101"], 2, ""),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else repr(v),
)
def test_gpukit_pick_answers_at_the_exact_limits(
    run_cli: CliRunner, tmp_path: Path, args: list[str], code: int, stdout: str
) -> None:
    env = {"GPUKIT_FAKE_NVML": str(A100), "GPUKIT_LOCK_DIR": str(tmp_path)}
    done = run_cli("pick", *args, env={**env, "CUDA_VISIBLE_DEVICES": None})
    assert (done.returncode, done.stdout) == (code, stdout), done.stderr
    assert "Traceback" not in done.stderr
