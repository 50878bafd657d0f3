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
        COMPLETE.json    written last, by rank 0, once every file above is on disk: each
                         file's size and digest

The ``sharded/`` folder is there only when the model is sharded; ``shared.pt`` then holds no
weights. Every file is created new and fsynced, then its folder; only then, after all ranks
agreed that their parts are on disk, rank 0 writes ``COMPLETE.json`` (atomically) naming each
file, its size and its digest (each rank digests the files it wrote, after their fsync), and
fsyncs the run's folder. A save without its marker is ignored by
:func:`newest` and removed by the next :func:`prune`; older complete saves are removed only
after a newer one is complete (the marker goes first, so a save half removed is never taken as
complete). A process killed at any moment therefore leaves the last complete save as it was.

Everything read back is a file that others or an accident may have changed. The trust model:

- The run's folder must belong to this user or to root, and others may not write it unless it
  has the sticky bit (as ``/tmp``): whoever can write a folder without it can replace any save
  in it. A folder a group can write without the sticky bit is warned about, not refused (a
  ``umask`` of 002 gives every folder of a user's private group that mode).
- A save is taken only from this user or root (a save ``sudo`` wrote); a co-user's save in a
  shared folder, however genuine, is passed over and said so. :func:`prune` removes only this
  user's saves, and never fails a save that is complete: what it cannot remove is logged.
- The marker is read bounded and parsed with :func:`gpukit.untrusted.parse_json`, its fields
  checked by type and range before anything is built from them; the files it names must be
  regular files of this user's, of the sizes it says, and a save is resumed only once every
  file's digest matches (:func:`verify`): a byte changed in place, a file cut short and
  rewritten, passes the sizes but not the digests, and the save is passed over to an older one.

The digests are :func:`gpukit.checkpoint.digests.digest`'s (XXH3-128), against accidents; the
ownership rules above are the defence against people.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from gpukit import output, untrusted
from gpukit.checkpoint import atomic as _atomic
from gpukit.checkpoint import digests as _digests
from gpukit.checkpoint.atomic import atomic_write, write_durable
from gpukit.checkpoint.digests import digest
from gpukit.errors import CheckpointError
from gpukit.holders import user_name
from gpukit.train.contents import check_records

__all__ = [
    "MARKER",
    "SHARDED",
    "SHARED",
    "SaveInfo",
    "check",
    "check_root",
    "finish",
    "fsync_folder",
    "load_part",
    "newest",
    "newest_read",
    "prune",
    "rank_file",
    "remove",
    "save_name",
    "verify",
    "write_part",
]

MARKER = _digests.MARKER
SHARED = _digests.SHARED
SHARDED = "sharded"
FORMAT = 2  # 2: each file's digest in the marker
# ASCII digits only: ``\d`` also matches other scripts' digits, which int() reads but other
# ranks' fixed-size name buffers and the name's own bounds do not expect.
_NAME = re.compile(r"^step-([0-9]{9,19})-([0-9a-f]{1,32})-([0-9]{1,9})$", re.ASCII)
_RANK = re.compile(r"^rank-([0-9]{5,9})\.pt$", re.ASCII)
# The files of the sharded part a marker may name: DCP's metadata, one data file per rank.
_SHARD_FILE = re.compile(r"^sharded/(?:\.metadata|__([0-9]{1,9})_0\.distcp)$", re.ASCII)
_DIGEST = re.compile(r"^[0-9a-f]{32}$", re.ASCII)
_MARKER_LIMIT = 1 << 20
_MAX_RANKS = 1 << 20
_MAX_STEP = (1 << 63) - 1

log = logging.getLogger("gpukit.train")
T = TypeVar("T")


def save_name(step: int, token: str, count: int) -> str:
    """The folder name of a save: its step, the run's token, the how-many-th save of the run."""
    if type(step) is not int or not 0 <= step <= _MAX_STEP:  # the caller checked it
        raise ValueError(f"step {step!r} is not a whole number from 0 to {_MAX_STEP}")
    return f"step-{step:09d}-{token}-{count}"


def rank_file(rank: int) -> str:
    """The name of ``rank``'s own file in a save."""
    return f"rank-{rank:05d}.pt"


def fsync_folder(folder: Path) -> None:
    """Make the entries of ``folder`` (files created, renamed in) durable: the checkpoint
    layer's one folder fsync, :func:`gpukit.checkpoint.atomic.fsync_folder`."""
    _atomic.fsync_folder(folder)


def write_part(folder: Path, name: str, write: Callable[[BinaryIO], object]) -> None:
    """Write one new file of a save (created, never overwritten; fsynced), then its folder."""
    write_durable(folder / name, write)
    fsync_folder(folder)


def own_files(folder: Path, rank: int) -> list[str]:
    """The files of the save in ``folder`` that ``rank`` wrote: its own file, on rank 0 the
    shared part too, and its shards of a sharded part (DCP's metadata on rank 0)."""
    names = [rank_file(rank)]
    if rank == 0:
        names.insert(0, SHARED)
    for name in _shard_files(folder):
        match = _SHARD_FILE.match(name)
        owner = 0 if match is None or match.group(1) is None else int(match.group(1))
        if owner == rank:
            names.append(name)
    return names


def finish(
    folder: Path, *, step: int, world_size: int, digests: dict[str, str] | None = None
) -> None:
    """Mark the save in ``folder`` complete: every part is on disk; then the marker, last.

    Args:
        folder: the save's folder, every rank's files written and fsynced.
        step: the step the save holds.
        world_size: how many processes wrote it.
        digests: each file's digest as the rank that wrote it computed it after its fsync;
            a file without one is digested here.

    Raises:
        CheckpointError: a part is missing (a rank did not write its file).
    """
    names = [SHARED, *(rank_file(r) for r in range(world_size))]
    if _shard_files(folder):  # each rank's shards and the metadata, or the save is incomplete
        names += _sharded_files(world_size)
    given = digests or {}
    sizes: dict[str, int] = {}
    sums: dict[str, str] = {}
    for name in names:
        try:
            sizes[name] = (folder / name).lstat().st_size
            sums[name] = given[name] if name in given else digest(folder / name)
        except (FileNotFoundError, untrusted.InvalidInput):
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
        "digests": sums,
        "digest": "xxh3-128",
        "time_ns": time.time_ns(),
    }
    data = output.dumps(marker).encode()
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
    digests: dict[str, str] = field(default_factory=dict)

    @property
    def sharded(self) -> bool:
        """Whether the save holds a sharded part (a DCP checkpoint in ``sharded/``)."""
        return any(name.startswith(f"{SHARDED}/") for name in self.files)


def _checked_marker(folder: Path) -> SaveInfo:
    try:
        raw = untrusted.read_file(folder / MARKER, _MARKER_LIMIT)
        found = untrusted.as_dict(untrusted.parse_json(raw, limit=_MARKER_LIMIT), what="marker")
        if found.get("format") == 1:
            raise untrusted.InvalidInput("it was written by an older gpukit, without digests")
        if found.get("format") != FORMAT:
            raise untrusted.InvalidInput(f"its format is not {FORMAT}")
        step = untrusted.as_int(found.get("step"), high=_MAX_STEP, what="step")
        named = _NAME.match(folder.name)
        if named is not None and int(named.group(1)) != step:  # the name is the save's own word
            raise untrusted.InvalidInput(
                f"its marker says step {step}, its name step {int(named.group(1))}"
            )
        world = untrusted.as_int(found.get("world_size"), low=1, high=_MAX_RANKS, what="world")
        files = untrusted.as_dict(found.get("files"), limit=2 * world + 2, what="files")
        if len(files) < world + 1:  # checked before a name is built for each of ``world``
            raise untrusted.InvalidInput(f"its marker names fewer files than {world} ranks write")
        sizes = {
            name: untrusted.as_int(size, what=f"size of {name}") for name, size in files.items()
        }
        sums = untrusted.as_dict(found.get("digests"), limit=len(files), what="digests")
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
    if set(sums) != set(sizes) or not all(
        type(value) is str and _DIGEST.match(value) for value in sums.values()
    ):
        raise untrusted.InvalidInput("its marker does not give one digest for each file")
    return SaveInfo(folder, step, world, sizes, when, dict(sums))


def _sharded_part_named(names: set[str], world: int) -> bool:
    """Whether ``names`` are none, or the whole sharded part of a save by ``world`` ranks."""
    return not names or names == set(_sharded_files(world))


def _sharded_files(world: int) -> list[str]:
    """The files of a sharded part written by ``world`` ranks: DCP's ``.metadata`` and one data
    file per rank (DCP's writer, with one thread, writes one file a rank, empty or not)."""
    return [f"{SHARDED}/.metadata", *(f"{SHARDED}/__{rank}_0.distcp" for rank in range(world))]


def check(folder: Path) -> SaveInfo:
    """The save in ``folder``, checked: its marker well-formed, its files there and whole,
    the folder and every file this user's or root's (its digests are :func:`verify`'s).

    Raises:
        CheckpointError: the save is incomplete, damaged or someone else's, saying what.
    """
    try:
        _check_owner(_lstat(folder, "the folder"), "it")
        info = _checked_marker(folder)
        if info.sharded and not stat.S_ISDIR(_lstat(folder / SHARDED, SHARDED).st_mode):
            raise untrusted.InvalidInput(f"{SHARDED} is not a folder")
        for name, size in info.files.items():
            found = _lstat(folder / name, name)
            if not stat.S_ISREG(found.st_mode):
                raise untrusted.InvalidInput(f"{name} is not a regular file")
            _check_owner(found, name)
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


def verify(info: SaveInfo) -> None:
    """Check every file of a checked save against the digest its marker gives.

    Raises:
        CheckpointError: a file's content is not what was written (a byte changed, a file
            replaced by another of the same size), or it cannot be read.
    """
    for name, expected in info.digests.items():
        try:
            found = digest(info.path / name)
        except (OSError, untrusted.InvalidInput) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else str(exc)
            raise CheckpointError(
                f"{info.path} is damaged: {name} cannot be read ({reason}).",
                hint="Resume from another save in that folder, or start the run again.",
            ) from None
        if found != expected:
            raise CheckpointError(
                f"{info.path} is damaged: {name} is not what was saved (its digest differs).",
                hint="The file changed after the save (a disk or copy error, or an edit); "
                "resume from another save in that folder, or start the run again.",
            )


def _trusted(uid: int) -> bool:
    """Whether a file of ``uid``'s may be taken: this user's own, or root's."""
    return uid in (0, os.geteuid())


def _check_owner(found: os.stat_result, what: str) -> None:
    if not _trusted(found.st_uid):
        raise untrusted.InvalidInput(
            f"{what} belongs to {user_name(found.st_uid)}: only your own saves (or root's) "
            "are resumed"
        )


def check_root(root: Path) -> None:
    """Check the run's folder against the trust model before a save or a resume uses it.

    Accepted when it does not exist yet (it will be made), or is a folder (a link the user
    made to one is followed) of this user's or root's that others cannot write unless it has
    the sticky bit. A folder a group can write without the sticky bit is accepted with a
    warning. A link someone else made is refused.

    Raises:
        CheckpointError: the folder, or a link to it, belongs to another user, or anyone may
            write it without the sticky bit: saves there could be replaced by someone else.
    """
    try:
        link = root.lstat()
        found = root.stat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CheckpointError(
            f"Cannot use {root} for saves: {exc.strerror}.",
            hint="Pass a folder this process can read and write.",
        ) from None
    if not stat.S_ISDIR(found.st_mode):
        raise CheckpointError(
            f"Cannot use {root} for saves: it is not a folder.",
            hint="Pass a folder (it is made if it does not exist).",
        )
    # A link is named only where there is one: a folder squatted in place is "the folder".
    named = [(link, "the link")] if stat.S_ISLNK(link.st_mode) else []
    for info, what in (*named, (found, "the folder")):
        if not _trusted(info.st_uid):
            raise CheckpointError(
                f"Refused the save folder {root}: {what} belongs to {user_name(info.st_uid)}, "
                "who could replace or plant saves in it.",
                hint="Save into a folder of your own (under your home, or a new one in a "
                f"shared scratch space), or ask {user_name(info.st_uid)} to remove {root}.",
            )
    sticky = bool(found.st_mode & stat.S_ISVTX)
    if found.st_mode & 0o002 and not sticky:
        raise CheckpointError(
            f"Refused the save folder {root}: anyone on this machine can write it "
            f"(mode {stat.S_IMODE(found.st_mode):04o}) and so replace the saves in it.",
            hint=f"Run `chmod o-w {root}` (or `chmod +t {root}` to share it as /tmp is).",
        )
    if found.st_mode & 0o020 and not sticky:
        log.warning(
            "the save folder %s can be written by its group (mode %04o): a member could "
            "replace its saves; `chmod g-w %s` if that group is not only you",
            root,
            stat.S_IMODE(found.st_mode),
            root,
        )


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
    """The newest complete save in ``root`` that passes :func:`check` and :func:`verify`, and
    why newer ones were passed over (one line each). Newest is the highest step, then the
    latest written; someone else's saves and damaged ones are passed over, never resumed.

    Raises:
        CheckpointError: ``root`` fails the trust model (:func:`check_root`) or cannot be read.
    """
    info, passed, _ = newest_read(root, None)
    return info, passed


def newest_read(
    root: Path, read: Callable[[SaveInfo], T] | None
) -> tuple[SaveInfo | None, list[str], T | None]:
    """:func:`newest`, and what ``read`` returns for the save chosen.

    ``read`` (say, ``torch.load`` of the save's files, as data) runs while the digests are
    verified in another thread (``xxhash`` leaves the interpreter's lock while it hashes), so
    that a resume reads each file from the disk once, not once for the digests and once more
    for its content. What it returns is handed on only once every digest matched: no loader
    of the caller's sees the content of a damaged save. A save that ``read`` refuses
    (``CheckpointError``) is passed over as a damaged one is.

    Raises:
        CheckpointError: ``root`` fails the trust model (:func:`check_root`) or cannot be read.
    """
    check_root(root)
    found: list[SaveInfo] = []
    passed: list[str] = []
    for path in _saves(root):
        try:
            _check_owner(_lstat(path, "the folder"), "it")
            found.append(_checked_marker(path))
        except untrusted.InvalidInput as exc:
            passed.append(f"{path.name}: {exc}")
    found.sort(key=lambda info: (info.step, info.time_ns), reverse=True)
    for info in found:
        try:
            checked = check(info.path)
            content = _verified_read(checked, read)
        except CheckpointError as exc:
            passed.append(f"{info.path.name}: {exc}")
            log.warning("passing over the damaged save %s: %s", info.path, exc)
            continue
        return checked, passed, content
    return None, passed, None


def _verified_read(info: SaveInfo, read: Callable[[SaveInfo], T] | None) -> T | None:
    """``read(info)`` while :func:`verify` runs beside it; its result once both are done."""
    if read is None:
        verify(info)
        return None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpukit-digests") as pool:
        verifying = pool.submit(verify, info)
        try:
            content = read(info)
        finally:
            verifying.result()  # a damaged save's error first: the digest says why
    return content


def remove(path: Path) -> bool:
    """Remove a save folder: its marker first, so that a half-removed save is never complete.

    Returns whether it is gone. What cannot be removed (a folder root or another user left,
    a read-only disk) is logged, never raised: a save is not made to fail by an older one.
    """
    try:
        with contextlib.suppress(FileNotFoundError):
            (path / MARKER).unlink()
            fsync_folder(path)
    except OSError as exc:
        log.warning("cannot remove the old save %s: %s", path, exc.strerror)
        return False
    shutil.rmtree(path, ignore_errors=True)  # never follows links inside
    if path.exists():
        log.warning("the old save %s is only partly removed (permissions?)", path)
        return False
    return True


def _later_of_same_run(path: Path, current: Path) -> bool:
    """Whether ``path`` is a save this run started after ``current`` (another rank may be
    writing it already while this one finishes ``current``)."""
    mine, other = _NAME.match(current.name), _NAME.match(path.name)
    assert mine is not None
    assert other is not None
    return other.group(2) == mine.group(2) and int(other.group(3)) > int(mine.group(3))


def _mine(path: Path) -> bool:
    try:
        return path.lstat().st_uid == os.geteuid()
    except OSError:
        return False


def prune(root: Path, *, keep: int, current: Path) -> list[Path]:
    """Remove all saves but the ``keep`` newest complete ones (``current`` among them) and the
    incomplete ones of earlier runs or of this run before ``current`` (their process died or
    they failed); return the removed folders.

    Only this user's saves are touched; one that cannot be removed is logged and left.
    """
    complete: list[SaveInfo] = []
    removed: list[Path] = []
    for path in _saves(root):
        if path == current or _later_of_same_run(path, current) or not _mine(path):
            continue
        try:
            complete.append(_checked_marker(path))
        except untrusted.InvalidInput:
            if remove(path):
                removed.append(path)
    complete.sort(key=lambda info: (info.step, info.time_ns), reverse=True)
    for info in complete[max(keep - 1, 0) :]:
        if remove(info.path):
            removed.append(info.path)
    return removed


def load_part(folder: Path, name: str) -> Any:
    """The content of one file of a checked save, read as data (``weights_only``), once its
    zip records are known to be stored (:func:`gpukit.train.contents.check_records`).

    Raises:
        CheckpointError: the file cannot be read, or is not as ``torch.save`` writes it.
    """
    from gpukit.checkpoint.single_file import read

    try:
        check_records(folder / name)
    except untrusted.InvalidInput as exc:
        raise CheckpointError(
            f"{folder / name} is not a training state's file: {exc}.",
            hint="Resume from another save in that folder, or start the run again.",
        ) from None
    return read(folder / name, target=None, trust=False, folder=folder).content
