"""The saves of a training state on disk: one folder per save, complete only once marked.

A run's folder holds one subfolder per save, ``step-<step>-<token>``::

    checkpoints/
      step-000001200-5f3a0c91d2e4-0/
        shared.pt        what every rank has alike (model, optimizer, loader...): rank 0 writes it
        rank-00000.pt    each rank's own (its random streams): written by that rank
        rank-00001.pt
        sharded/         a sharded (FSDP2) model's and optimizer's state, a DCP checkpoint:
          __0_0.distcp     rank 0's shards, written by rank 0
          __1_0.distcp     rank 1's shards, written by rank 1
          .metadata        where each chunk lies: written by rank 0 once every shard is written
        COMPLETE.json    written last, by rank 0, once every file above is on disk

The ``sharded/`` folder is there only when the model is sharded; ``shared.pt`` then holds no
weights. Every file is created new and fsynced, then its folder; only then, after all ranks
agreed that their parts are on disk, rank 0 writes ``COMPLETE.json`` (atomically) naming each
file and its size, and fsyncs the run's folder. A save without its marker is ignored by
:func:`newest` and removed by the next :func:`prune`; older complete saves are removed only
after a newer one is complete (the marker goes first, so a save half removed is never taken as
complete). A process killed at any moment therefore leaves the last complete save as it was.

Everything read back is a file that others may have changed: the marker is read bounded and
parsed with :func:`gpukit.untrusted.parse_json`, its fields checked by type and range, and the
files it names must be regular files of the sizes it says.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gpukit import untrusted
from gpukit.checkpoint.atomic import atomic_write, write_durable
from gpukit.errors import CheckpointError

__all__ = [
    "MARKER",
    "SHARDED",
    "SHARED",
    "SaveInfo",
    "check",
    "finish",
    "fsync_folder",
    "load_part",
    "newest",
    "prune",
    "rank_file",
    "remove",
    "save_name",
    "write_part",
]

MARKER = "COMPLETE.json"
SHARED = "shared.pt"
SHARDED = "sharded"
FORMAT = 1
_NAME = re.compile(r"^step-(\d{9,19})-([0-9a-f]{1,32})-(\d{1,9})$")
_RANK = re.compile(r"^rank-(\d{5,9})\.pt$")
# The files of the sharded part a marker may name: DCP's metadata, one data file per rank.
_SHARD_FILE = re.compile(r"^sharded/(?:\.metadata|__(\d{1,9})_0\.distcp)$")
_MARKER_LIMIT = 1 << 20
_MAX_RANKS = 1 << 20

log = logging.getLogger("gpukit.train")


def save_name(step: int, token: str, count: int) -> str:
    """The folder name of a save: its step, the run's token, the how-many-th save of the run."""
    return f"step-{step:09d}-{token}-{count}"


def rank_file(rank: int) -> str:
    """The name of ``rank``'s own file in a save."""
    return f"rank-{rank:05d}.pt"


def fsync_folder(folder: Path) -> None:
    """Make the entries of ``folder`` (files created, renamed in) durable (POSIX)."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_part(folder: Path, name: str, write: Callable[[BinaryIO], object]) -> None:
    """Write one new file of a save (created, never overwritten; fsynced), then its folder."""
    write_durable(folder / name, write)
    fsync_folder(folder)


def finish(folder: Path, *, step: int, world_size: int) -> None:
    """Mark the save in ``folder`` complete: every part is on disk; then the marker, last.

    Raises:
        CheckpointError: a part is missing (a rank did not write its file).
    """
    names = [SHARED, *(rank_file(r) for r in range(world_size)), *_shard_files(folder)]
    sizes: dict[str, int] = {}
    for name in names:
        try:
            sizes[name] = (folder / name).lstat().st_size
        except FileNotFoundError:
            raise CheckpointError(
                f"Cannot complete the save {folder}: {name} is missing.",
                hint="Every rank must call save() at the same step; the save was left "
                "incomplete and the previous complete save is still the one resumed.",
            ) from None
    marker = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "files": sizes,
        "time_ns": time.time_ns(),
    }
    data = untrusted.dumps(marker).encode()
    fsync_folder(folder)

    def write(handle: BinaryIO, _path: Path) -> None:
        handle.write(data)

    atomic_write(folder / MARKER, write)
    fsync_folder(folder.parent)


def _shard_files(folder: Path) -> list[str]:
    """The files of the save's sharded part (none without one), as the marker names them."""
    try:
        entries = list(os.scandir(folder / SHARDED))
    except FileNotFoundError:
        return []
    return sorted(f"{SHARDED}/{entry.name}" for entry in entries)


@dataclass(frozen=True)
class SaveInfo:
    """A complete save, as its marker describes it (checked)."""

    path: Path
    step: int
    world_size: int
    files: dict[str, int]
    time_ns: int

    @property
    def sharded(self) -> bool:
        """Whether the save holds a sharded part (a DCP checkpoint in ``sharded/``)."""
        return any(name.startswith(f"{SHARDED}/") for name in self.files)


def _checked_marker(folder: Path) -> SaveInfo:
    try:
        raw = untrusted.read_file(folder / MARKER, _MARKER_LIMIT)
        found = untrusted.as_dict(untrusted.parse_json(raw, limit=_MARKER_LIMIT), what="marker")
        if found.get("format") != FORMAT:
            raise untrusted.InvalidInput(f"its format is not {FORMAT}")
        step = untrusted.as_int(found.get("step"), what="step")
        world = untrusted.as_int(found.get("world_size"), low=1, high=_MAX_RANKS, what="world")
        files = untrusted.as_dict(found.get("files"), limit=2 * world + 2, what="files")
        sizes = {
            name: untrusted.as_int(size, what=f"size of {name}") for name, size in files.items()
        }
        when = untrusted.as_int(found.get("time_ns"), what="time")
    except FileNotFoundError:
        raise untrusted.InvalidInput("it has no marker: it is incomplete") from None
    except OSError as exc:
        raise untrusted.InvalidInput(f"its marker cannot be read ({exc.strerror})") from None
    expected = {SHARED, *(rank_file(r) for r in range(world))}
    sharded = set(sizes) - expected
    if not expected <= set(sizes) or not _sharded_part_named(sharded, world):
        raise untrusted.InvalidInput(
            f"its marker names other files than those of a save by {world} processes"
        )
    return SaveInfo(folder, step, world, sizes, when)


def _sharded_part_named(names: set[str], world: int) -> bool:
    """Whether ``names`` are none, or the files of a sharded part written by ``world`` ranks:
    its ``.metadata`` and data files of ranks below ``world``."""
    if not names:
        return True
    for name in names:
        match = _SHARD_FILE.match(name)
        if match is None or (match.group(1) is not None and int(match.group(1)) >= world):
            return False
    return f"{SHARDED}/.metadata" in names


def check(folder: Path) -> SaveInfo:
    """The save in ``folder``, checked: its marker well-formed, its files there and whole.

    Raises:
        CheckpointError: the save is incomplete or damaged, saying what is wrong.
    """
    try:
        info = _checked_marker(folder)
        if info.sharded and not stat.S_ISDIR(_lstat(folder / SHARDED, SHARDED).st_mode):
            raise untrusted.InvalidInput(f"{SHARDED} is not a folder")
        for name, size in info.files.items():
            found = _lstat(folder / name, name)
            if not stat.S_ISREG(found.st_mode):
                raise untrusted.InvalidInput(f"{name} is not a regular file")
            if found.st_size != size:
                raise untrusted.InvalidInput(
                    f"{name} has {found.st_size} bytes, the marker says {size}"
                )
    except untrusted.InvalidInput as exc:
        raise CheckpointError(
            f"{folder} is not a complete save: {exc}.",
            hint="Resume from another save in that folder, or start the run again.",
        ) from None
    return info


def _lstat(path: Path, name: str) -> os.stat_result:
    try:
        return path.lstat()
    except FileNotFoundError:
        raise untrusted.InvalidInput(f"{name} is missing") from None


def _saves(root: Path) -> list[Path]:
    """The save folders in ``root`` (complete or not), real folders only, never links."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckpointError(
            f"Cannot list the saves in {root}: {exc.strerror}.",
            hint="Pass a folder this process can read.",
        ) from None
    return [
        Path(entry.path)
        for entry in entries
        if _NAME.match(entry.name) and entry.is_dir(follow_symlinks=False)
    ]


def newest(root: Path) -> tuple[SaveInfo | None, list[str]]:
    """The newest complete save in ``root`` that passes :func:`check`, and why newer ones
    were passed over (one line each). Newest is the highest step, then the latest written."""
    found: list[SaveInfo] = []
    passed: list[str] = []
    for path in _saves(root):
        try:
            found.append(_checked_marker(path))
        except untrusted.InvalidInput as exc:
            passed.append(f"{path.name}: {exc}")
    found.sort(key=lambda info: (info.step, info.time_ns), reverse=True)
    for info in found:
        try:
            return check(info.path), passed
        except CheckpointError as exc:
            passed.append(f"{info.path.name}: {exc}")
            log.warning("passing over the damaged save %s: %s", info.path, exc)
    return None, passed


def remove(path: Path) -> None:
    """Remove a save folder: its marker first, so that a half-removed save is never complete."""
    with contextlib.suppress(FileNotFoundError):
        (path / MARKER).unlink()
        fsync_folder(path)
    shutil.rmtree(path, ignore_errors=True)  # never follows links inside


def _later_of_same_run(path: Path, current: Path) -> bool:
    """Whether ``path`` is a save this run started after ``current`` (another rank may be
    writing it already while this one finishes ``current``)."""
    mine, other = _NAME.match(current.name), _NAME.match(path.name)
    assert mine is not None
    assert other is not None
    return other.group(2) == mine.group(2) and int(other.group(3)) > int(mine.group(3))


def prune(root: Path, *, keep: int, current: Path) -> list[Path]:
    """Remove all saves but the ``keep`` newest complete ones (``current`` among them) and the
    incomplete ones of earlier runs or of this run before ``current`` (their process died or
    they failed); return the removed folders."""
    complete: list[SaveInfo] = []
    removed: list[Path] = []
    for path in _saves(root):
        if path == current or _later_of_same_run(path, current):
            continue
        try:
            complete.append(_checked_marker(path))
        except untrusted.InvalidInput:
            remove(path)
            removed.append(path)
    complete.sort(key=lambda info: (info.step, info.time_ns), reverse=True)
    for info in complete[max(keep - 1, 0) :]:
        remove(info.path)
        removed.append(info.path)
    return removed


def load_part(folder: Path, name: str) -> Any:
    """The content of one file of a checked save, read as data (``weights_only``)."""
    from gpukit.checkpoint.single_file import read

    return read(folder / name, target=None, trust=False, folder=folder).content
