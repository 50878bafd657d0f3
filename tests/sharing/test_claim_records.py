"""A claim's lock file: the lock says whether a GPU is held, the record only who holds it.

Anyone can write a lock file (it is shared, mode 0666), so a co-user can empty or blank the
record of a claim someone else holds. These tests plant such records and check that the GPU
still reads as held, by the holder the kernel's lock table names.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
from pathlib import Path

import pytest

from gpukit.errors import ClaimError
from gpukit.gpus.criteria import Criteria
from gpukit.gpus.inventory import inventory
from gpukit.gpus.select import choose
from gpukit.sharing.claims import claim, current_claims, holder_of
from gpukit.sharing.report import sharing
from tests.helpers import MACHINES

L4 = MACHINES / "server-4xL4-idle.json"
ME = pwd.getpwuid(os.getuid()).pw_name


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(L4))
    return folder


@pytest.fixture
def first_gpu() -> str:
    return inventory().gpus[0].uuid


@pytest.mark.parametrize("content", [b"", b"  \n\t "], ids=["emptied", "blanked"])
def test_a_held_claim_whose_record_a_co_user_emptied_is_still_held_by_the_kernels_holder(
    locks: Path, first_gpu: str, content: bytes
) -> None:
    with claim([first_gpu], command="python train.py"):
        path = locks / f"{first_gpu}.lock"
        path.write_bytes(content)  # what anyone can do to a 0666 lock file
        holder = current_claims()[first_gpu]
        assert (holder.user, holder.pid, holder.problem) == (ME, os.getpid(), "record unreadable")
        assert holder.describe().startswith(f"{ME} (pid {os.getpid()}")
        assert holder.describe().endswith(", record unreadable")
        assert holder_of(path) == holder


def test_a_gpu_whose_held_record_was_emptied_is_not_offered_and_cannot_be_claimed(
    locks: Path, first_gpu: str
) -> None:
    with claim([first_gpu]):
        (locks / f"{first_gpu}.lock").write_bytes(b"")
        inv = inventory()
        chosen = choose(inv, len(inv.gpus) - 1, Criteria(), claims=current_claims())
        assert first_gpu not in [g.uuid for g in chosen]
        with pytest.raises(ClaimError, match="record unreadable"):
            claim([first_gpu])


def test_an_empty_lock_file_locked_without_a_record_is_a_claim_queue_shows(
    locks: Path, first_gpu: str
) -> None:
    locks.mkdir()
    fd = os.open(locks / f"{first_gpu}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert current_claims()[first_gpu].pid == os.getpid()
        (held,) = sharing(observe=False).holders
        assert (held.uuids, held.pid, held.user) == ((first_gpu,), os.getpid(), ME)
    finally:
        os.close(fd)
    assert current_claims() == {}  # the lock, not the empty content, said it was held


def test_a_record_rewritten_shorter_than_the_one_before_leaves_no_stale_tail(
    locks: Path, first_gpu: str
) -> None:
    # A holder killed with SIGKILL leaves its record behind; the next claim writes over it.
    locks.mkdir()
    long = {"user": "x", "pid": 1, "host": "h", "command": "y" * 4000, "since": 1.0}
    (locks / f"{first_gpu}.lock").write_text(json.dumps(long))
    with claim([first_gpu], command="short"):
        data = (locks / f"{first_gpu}.lock").read_bytes()
        assert json.loads(data)["command"] == "short"
        assert data.endswith(b"}")
