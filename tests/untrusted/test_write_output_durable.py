"""Rule: an output lands whole after a power cut: its bytes are fsynced before the rename.

``write_output`` writes a temporary file and renames it over the name. Without an fsync of the
temporary file first, the rename can reach the disk before the data: after a crash the name
holds an empty or partial file where the old one was. Each ``os.fsync`` is recorded with the
file its descriptor names and what that file held at that moment; each rename with the paths
it moved from and to.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpukit.output import write_output

Event = tuple[str, str, bytes | str]


def _path(name: str | os.PathLike[str] | bytes | int, dir_fd: int | None) -> str:
    """The path ``name`` (relative to ``dir_fd``, if given) stands for, its folder resolved."""
    assert isinstance(name, (str, os.PathLike))
    folder, base = os.path.split(os.fspath(name))
    if dir_fd is None:
        return os.path.join(os.path.realpath(folder or "."), base)
    return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), folder, base)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """Record fsyncs (the file, its content then) and renames (from, to) in their order."""
    seen: list[Event] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        real_fsync(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        with open(path, "rb") as synced:
            seen.append(("fsync", path, synced.read()))

    def moved(real: Callable[..., None], kind: str) -> Callable[..., None]:
        def move(
            src: str,
            dst: str,
            *,
            src_dir_fd: int | None = None,
            dst_dir_fd: int | None = None,
        ) -> None:
            seen.append((kind, _path(src, src_dir_fd), _path(dst, dst_dir_fd)))
            real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

        return move

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", moved(real_rename, "rename"))
    monkeypatch.setattr(os, "replace", moved(real_replace, "replace"))
    return seen


@pytest.mark.parametrize("before", [None, b"the old report"], ids=["new", "replacing"])
def test_the_bytes_are_on_disk_before_the_output_takes_its_name(
    tmp_path: Path, events: list[Event], before: bytes | None
) -> None:
    out = tmp_path / "report.json"
    if before is not None:
        out.write_bytes(before)
    write_output(out, b'{"done": true}')
    assert out.read_bytes() == b'{"done": true}'
    (moved,) = [e for e in events if e[0] in ("rename", "replace")]
    _, temporary, target = moved
    assert target == os.path.realpath(out)
    assert temporary != target
    synced = [e for e in events[: events.index(moved)] if e[:2] == ("fsync", temporary)]
    assert synced, f"the temporary file was never fsynced before it was renamed: {events}"
    assert synced[-1][2] == b'{"done": true}'  # the whole content, not a part of it
