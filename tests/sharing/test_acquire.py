"""gk.acquire: gpukit run's pick / wait / claim in one library call, with its errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import gpukit as gk
from gpukit.errors import (
    InvalidArgumentError,
    NoGpuAvailableError,
    WaitTimeoutError,
)
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.sharing.claims import claim, current_claims
from gpukit.sharing.waiters import read_queue
from tests.helpers import MACHINES

L4 = MACHINES / "server-4xL4-idle.json"
ONE_LOST = MACHINES / "kaggle-2xT4-one-lost.json"


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(L4))
    monkeypatch.delenv("GPUKIT_POLL_INTERVAL", raising=False)
    return folder


def test_acquire_claims_the_best_gpus_now_and_records_the_command() -> None:
    with gk.acquire(2, order="index", command="python train.py") as held:
        assert held.indices == [0, 1]
        assert {h.command for h in current_claims().values()} == {"python train.py"}
    assert current_claims() == {}


def test_acquire_without_wait_explains_why_too_few_qualify() -> None:
    with claim(inventory().gpus[1:]), pytest.raises(NoGpuAvailableError) as info:
        gk.acquire(2)
    assert info.value.exit_code == 4
    assert "GPU 1: claimed by" in info.value.message


def test_acquire_waits_in_line_until_a_gpu_is_released() -> None:
    gpus = inventory().gpus
    others = claim(gpus[1:])
    blocker = claim(gpus[:1])
    polls: list[int] = []

    def read() -> Inventory:
        polls.append(1)
        if len(polls) == 3:
            blocker.release()  # the holder of GPU 0 finishes between the 2nd and 3rd poll
        return inventory()

    with gk.acquire(wait=True, poll=0.01, settle=1, read=read) as held:
        assert held.indices == [0]
        assert len(polls) == 3
    others.release()
    assert read_queue().waiters == ()


def test_acquire_with_a_timeout_waits_and_gives_up_with_exit_124(locks: Path) -> None:
    with claim(inventory().gpus), pytest.raises(WaitTimeoutError) as info:
        gk.acquire(timeout=0.05, poll=0.01)
    assert info.value.exit_code == 124
    assert list((locks / "queue").iterdir()) == []


def test_acquire_never_waits_for_a_gpu_nvml_has_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(ONE_LOST))
    with pytest.raises(NoGpuAvailableError) as info:
        gk.acquire(2, wait=True, timeout=600, poll=600)
    assert "Waiting cannot help: only 1 could ever qualify" in str(info.value)
    assert "GPU 1: unreadable by NVML" in info.value.message


@pytest.mark.parametrize("exclude", [7, "7", "GPU-ffff", "²", "GPU-", -1], ids=repr)
def test_pick_and_acquire_refuse_an_exclusion_that_names_no_single_gpu(
    exclude: int | str,
) -> None:
    with pytest.raises(InvalidArgumentError, match="Cannot exclude") as info:
        gk.pick(exclude=[exclude])
    assert info.value.exit_code == 2
    assert "GPU-" in info.value.message  # it lists what the machine has
    with pytest.raises(InvalidArgumentError, match="Cannot exclude"):
        gk.acquire(exclude=[exclude], wait=True)
    assert current_claims() == {}


def test_an_exclusion_by_uuid_keeps_that_gpu_free() -> None:
    gpus = inventory().gpus
    with gk.acquire(3, exclude=[gpus[2].uuid], order="index") as held:
        assert held.indices == [0, 1, 3]


def test_an_exclusion_by_a_uuid_prefix_that_names_several_gpus_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="prefix of the UUIDs of GPUs 0, 1, 2, 3"):
        gk.acquire(exclude=["GPU-4a1d2e10-"])


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"wait": "yes"}, "wait='yes'"),
        ({"wait": 1}, "wait=1"),
        ({"poll": math.nan}, "poll=nan"),
        ({"poll": 0}, "poll=0"),
        ({"poll": math.inf}, "poll=inf"),
        ({"timeout": -1}, "timeout=-1"),
        ({"timeout": math.nan}, "timeout=nan"),
        ({"settle": 0}, "settle=0"),
        ({"order": "random"}, "order='random'"),
        ({"n": 0}, "0 GPUs"),
        ({"n": True}, "True GPUs"),
    ],
)
def test_acquire_refuses_bad_arguments_with_a_typed_error(
    kwargs: dict[str, object], what: str
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        gk.acquire(**kwargs)  # type: ignore[arg-type]
    assert what in info.value.message
    assert current_claims() == {}


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-1", "0", ""])
def test_a_poll_interval_from_the_environment_that_is_not_seconds_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("GPUKIT_POLL_INTERVAL", value)
    with pytest.raises(InvalidArgumentError, match="GPUKIT_POLL_INTERVAL"):
        gk.acquire()
    assert current_claims() == {}


def test_the_poll_interval_comes_from_the_environment_when_not_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpukit.sharing.acquire import poll_interval

    assert poll_interval() == 2.0
    monkeypatch.setenv("GPUKIT_POLL_INTERVAL", "0.25")
    assert poll_interval() == 0.25
    assert poll_interval(5) == 5.0


A100 = MACHINES / "server-8xA100-shared.json"  # 8 alike GPUs; only 2 and 4 idle


def _scheduler_grant(monkeypatch: pytest.MonkeyPatch, *indices: int) -> None:
    """CUDA_VISIBLE_DEVICES as a scheduler sets it: the granted GPUs' full UUIDs."""
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(A100))
    uuids = {g.index: g.uuid for g in inventory().gpus}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(uuids[i] for i in indices))


def test_acquire_inside_a_grant_speaks_of_the_granted_gpus_not_of_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _scheduler_grant(monkeypatch, 3, 5)  # both busy
    with pytest.raises(NoGpuAvailableError) as info:
        gk.acquire(1)
    message = info.value.message
    assert message.startswith(
        "Asked for 1 GPU with no process on it, of the 2 GPUs (3, 5) granted by "
        "CUDA_VISIBLE_DEVICES: 0 of 2 qualify.\n  GPU 3: "
    )
    assert [line.split(":")[0] for line in message.splitlines()[1:]] == ["  GPU 3", "  GPU 5"]
    assert "GPU-" not in message
    assert "excluded" not in message


def test_a_waiter_inside_a_grant_says_and_records_the_grant_by_index(
    monkeypatch: pytest.MonkeyPatch, locks: Path
) -> None:
    _scheduler_grant(monkeypatch, 3, 5)
    statuses: list[str] = []
    recorded: list[str] = []

    def status(text: str) -> None:
        statuses.append(text)
        recorded.extend(w.criteria for w in read_queue(locks).waiters)

    with pytest.raises(WaitTimeoutError) as info:
        gk.acquire(1, timeout=0, poll=0.01, settle=3, on_status=status)
    assert statuses == [
        "waiting for 1 GPU (no process on it, granted GPUs 3,5): 0 of 2 qualify, "
        "0 for 3 polls in a row"
    ]
    assert recorded == ["no process on it, granted GPUs 3,5"]  # what `gpukit queue` shows
    assert "of the 2 GPUs (3, 5) granted by CUDA_VISIBLE_DEVICES: 0 of 2" in info.value.message


def test_an_exclusion_outside_the_grant_is_no_error_and_one_inside_it_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _scheduler_grant(monkeypatch, 2, 3, 4)
    with gk.acquire(1, exclude=[0, 4]) as held:
        assert held.indices == [2]


def test_a_job_granted_the_readable_gpu_of_a_machine_with_a_lost_one_gets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(ONE_LOST))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with gk.acquire(1) as held:
        assert held.indices == [0]
