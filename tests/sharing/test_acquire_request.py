"""A GPU request is checked once, when it is made, and carried out from readings taken once."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import gpukit as gk
import gpukit.cli.main
import gpukit.cli.run as run_cmd
import gpukit.sharing.acquire
import gpukit.sharing.ledger
import gpukit.sharing.lockfiles as lockfiles
import gpukit.sharing.policy
import gpukit.sharing.tickets
from gpukit.errors import InvalidArgumentError
from gpukit.gpus.criteria import Criteria
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.sharing.acquire import GpuRequest, acquire_request, poll_interval
from gpukit.sharing.claims import current_claims, shared_folder
from gpukit.sharing.lock_folder import lock_folder
from gpukit.sharing.policy import load_policy
from tests.helpers import MACHINES

A100 = MACHINES / "server-8xA100-shared.json"  # 8 GPUs; 2 and 4 idle
L4 = MACHINES / "server-4xL4-idle.json"


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(L4))
    monkeypatch.delenv("GPUKIT_POLL_INTERVAL", raising=False)
    return folder


def _count(monkeypatch: pytest.MonkeyPatch, function: Callable[..., Any]) -> list[object]:
    """Calls of ``function``, under whatever name any gpukit module holds it."""
    calls: list[object] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return function(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("gpukit"):
            for name, value in list(vars(module).items()):
                if value is function:
                    monkeypatch.setattr(module, name, counted)
    return calls


def _count_method(monkeypatch: pytest.MonkeyPatch, name: str) -> list[object]:
    calls: list[object] = []
    method = getattr(Criteria, name)

    def counted(self: Criteria, *args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return method(self, *args, **kwargs)

    monkeypatch.setattr(Criteria, name, counted)
    return calls


def test_gpukit_run_checks_its_request_once_and_reads_the_machine_once(
    monkeypatch: pytest.MonkeyPatch, locks: Path
) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(A100))
    shared_folder(locks)  # the lock folder exists, as after a machine's first claim
    monkeypatch.setattr(run_cmd, "supervise", lambda argv, env, **_: 0)
    make = Criteria.make.__func__  # type: ignore[attr-defined]
    made: list[object] = []

    def counted_make(cls: type[Criteria], **kwargs: Any) -> Criteria:
        made.append(kwargs)
        return make(cls, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(Criteria, "make", classmethod(counted_make))
    counts = {
        "criteria made": made,
        "exclusions checked": _count_method(monkeypatch, "check_exclude"),
        "poll interval": _count(monkeypatch, poll_interval),
        "policy loaded": _count(monkeypatch, load_policy),
        "lock folder found": _count(monkeypatch, lock_folder),
        "machine read": _count(monkeypatch, inventory),
    }
    opened = _count(monkeypatch, lockfiles.open_folder)

    assert gpukit.cli.main.main(["run", "-n", "2", "--", "true"]) == 0

    assert {what: len(calls) for what, calls in counts.items()} == dict.fromkeys(counts, 1)
    # The policy, who holds the GPUs, the claim, and the ledger's start and end: one each.
    assert len(opened) <= 5
    assert current_claims(locks) == {}


def test_a_waiter_reads_the_machine_once_before_its_first_poll() -> None:
    reads: list[int] = []

    def read() -> Inventory:
        reads.append(1)
        return inventory()

    with gk.acquire(2, wait=True, settle=1, poll=0.01, timeout=30, read=read) as held:
        assert len(held.indices) == 2
    assert reads == [1]


def test_acquiring_a_request_checks_none_of_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    request = GpuRequest(2, Criteria.make(min_free="1GiB"), order="index", poll=0.5)
    checked = _count(monkeypatch, poll_interval) + _count(
        monkeypatch, gpukit.sharing.acquire._seconds
    )
    with acquire_request(request, inventory()) as held:
        assert held.indices == [0, 1]
    assert checked == []


def test_a_request_with_a_timeout_waits_and_an_endless_one_has_no_limit() -> None:
    assert GpuRequest(timeout=60).wait is True
    endless = GpuRequest(timeout=math.inf)
    assert (endless.wait, endless.timeout) == (True, None)
    assert GpuRequest().poll == 2.0  # resolved when made, not when waiting


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"n": 0}, "0 GPUs"),
        ({"criteria": {"min_free": 1}}, "are not Criteria"),
        ({"order": "random"}, "order='random'"),
        ({"settle": 0}, "settle=0"),
        ({"poll": -1}, "poll=-1"),
        ({"timeout": math.nan}, "timeout=nan"),
        ({"wait": "yes"}, "wait='yes'"),
    ],
)
def test_a_request_with_a_bad_field_is_refused_when_made(fields: dict[str, Any], what: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        GpuRequest(**fields)
    assert what in info.value.message


def test_acquiring_something_other_than_a_request_is_a_typed_error() -> None:
    with pytest.raises(InvalidArgumentError, match="not a GpuRequest"):
        acquire_request({"n": 2})  # type: ignore[arg-type]
    assert current_claims() == {}
