"""gk.save is durable: the file's bytes reach the disk before the rename, the rename after it.

A rename is atomic but not durable by itself: without an fsync of the file first, a power cut
can leave the new name pointing at an empty file; without an fsync of the folder after, the
rename itself can be lost. These tests record the calls in order, on which file, and how much of
the file was written when its fsync ran.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.checkpoint.atomic import TMP_SUFFIX, atomic_write

Event = tuple[object, ...]


@pytest.fixture
def disk_calls(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """Every os.fsync (what it synced, its inode, the size then) and os.replace, in order."""
    events: list[Event] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        info = os.fstat(fd)
        kind = "folder" if stat.S_ISDIR(info.st_mode) else "file"
        events.append(("fsync", kind, info.st_ino, info.st_size if kind == "file" else None))
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("replace", Path(src).name.endswith(TMP_SUFFIX), Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("name", ["model.pt", "model.safetensors"])
def test_save_fsyncs_the_whole_file_then_renames_then_fsyncs_the_folder(
    tmp_path: Path, disk_calls: list[Event], name: str
) -> None:
    target = gk.save(_model(), tmp_path / name)
    on_disk = target.stat()
    assert disk_calls == [
        ("fsync", "file", on_disk.st_ino, on_disk.st_size),  # every byte, before the rename
        ("replace", True, name),  # the temporary file onto the target
        ("fsync", "folder", tmp_path.stat().st_ino, None),  # the rename itself
    ]


def test_overwriting_a_checkpoint_is_as_durable_as_the_first_save(
    tmp_path: Path, disk_calls: list[Event]
) -> None:
    gk.save(_model(), tmp_path / "last.pt")
    disk_calls.clear()
    target = gk.save({"model": _model(), "step": 2}, tmp_path / "last.pt")
    assert [e[:2] for e in disk_calls] == [
        ("fsync", "file"),
        ("replace", True),
        ("fsync", "folder"),
    ]
    assert disk_calls[0][2] == target.stat().st_ino


@pytest.mark.parametrize("fadvise", [True, False], ids=["linux", "without-posix_fadvise"])
def test_atomic_write_syncs_what_a_writer_left_in_pythons_buffer(
    tmp_path: Path, disk_calls: list[Event], monkeypatch: pytest.MonkeyPatch, fadvise: bool
) -> None:
    if not fadvise:  # as on macOS, where the file object is handed to the writer as it is
        monkeypatch.delattr(os, "posix_fadvise", raising=False)

    def writer(handle: BinaryIO, _: Path) -> None:
        handle.write(b"x" * 1000)  # never flushed: the bytes sit in the file object's buffer

    atomic_write(tmp_path / "data.bin", writer)
    assert disk_calls[0][:2] == ("fsync", "file")
    assert disk_calls[0][3] == 1000
    assert (tmp_path / "data.bin").read_bytes() == b"x" * 1000


def test_a_failing_fsync_fails_the_save_and_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = gk.save({"w": torch.zeros(3)}, tmp_path / "ckpt.pt")
    before = target.read_bytes()

    def broken_disk(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_disk)
    with pytest.raises(OSError, match="Input/output error"):
        gk.save({"w": torch.ones(3)}, target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temporary left
