"""One save's writing: each rank's files, the ranks' meeting, then rank 0's marker.

Run by the training state's background thread (or inline for a blocking save). Every rank writes
its shards of a sharded model (DCP, into ``sharded/``), then its files, then all ranks meet (an
all-reduce of "my part is on disk" in the saves' own gloo group, where DCP meets too, so that a
rank whose write failed does not leave the others waiting); only when all parts are there does
rank 0 mark the save complete and remove the saves beyond ``keep``. Each rank digests the files
it wrote, after their fsync, and the digests reach rank 0 in that same meeting (a gather), for
the marker; rank 0 then tells every rank whether the marker is written, so that every rank's
``wait()`` returns only once the save is complete on disk, and a marker that could not be
written fails the save on every rank. A failed save is removed, and the error raised to whoever
waits for the save; a full disk is said to be one. Removing older saves never fails a save that
is complete: what cannot be removed is logged.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import gpukit.train._sharded_part as _sharded_part
import gpukit.train.saves as saves
from gpukit._agree import from_rank_0, gathered
from gpukit.checkpoint.digests import digest
from gpukit.checkpoint.paths import fs_error
from gpukit.errors import CheckpointError

__all__ = ["SaveJob"]

log = logging.getLogger("gpukit.train")


@dataclass
class SaveJob:
    """One save's writing, run in the background thread (or inline when blocking)."""

    folder: Path
    step: int
    rank: int
    world: int
    keep: int
    group: Any
    shared: dict[str, Any] | None
    own: dict[str, Any]
    sharded: dict[str, Any] | None = None
    """This rank's shards of a sharded model and optimizer (every rank has them, or none)."""

    def run(self) -> Path:
        failure: BaseException | None = None
        if self.sharded is not None:
            try:
                # Its files and the folder fsynced by the checkpoint layer's DCP writer.
                _sharded_part.write(self.folder / saves.SHARDED, self.sharded, self.group)
            except BaseException as exc:  # every rank has it: DCP told them all
                failure = exc
            self.sharded = None
        digests: dict[str, str] = {}
        try:
            if failure is None:
                self._write_files()
                digests = self._digests()
        except BaseException as exc:  # reported after all ranks know, so none waits forever
            failure = exc
        self.shared = None  # the host copies are not needed any more
        if self.world > 1:
            failure = self._meet(failure, digests)
        elif failure is None:
            failure = self._finish(digests)
        if failure is not None:
            if self.rank == 0:
                with contextlib.suppress(OSError):
                    saves.remove(self.folder)  # nothing half-written is left behind
            if isinstance(failure, OSError):
                raise fs_error(self.folder, failure, "write the save") from failure
            raise failure
        if self.rank == 0:
            try:
                saves.prune(self.folder.parent, keep=self.keep, current=self.folder)
            except Exception as exc:  # the save is complete: an old one left is only a warning
                log.warning("could not remove the saves older than %s: %s", self.folder, exc)
        return self.folder

    def _digests(self) -> dict[str, str]:
        """The digest of each file this rank wrote (already fsynced)."""
        return {
            name: digest(self.folder / name) for name in saves.own_files(self.folder, self.rank)
        }

    def _finish(self, digests: dict[str, str]) -> BaseException | None:
        """Rank 0's marker, last; the error it met, if any."""
        try:
            saves.finish(self.folder, step=self.step, world_size=self.world, digests=digests)
        except BaseException as exc:
            return exc
        return None

    def _meet(self, failure: BaseException | None, digests: dict[str, str]) -> BaseException | None:
        """Every rank says whether its part is on disk, with its digests (gathered in the saves'
        group); rank 0 writes the marker when all parts are there, then tells every rank
        whether the save is complete. So no rank waits forever for
        one whose write failed, and none returns before the marker is on disk."""
        every = gathered((failure is None, digests if failure is None else {}), self.group)
        if self.rank == 0 and failure is None:
            if all(done for done, _ in every):
                failure = self._finish({k: v for _, sums in every for k, v in sums.items()})
            else:
                failure = _failed_elsewhere(self.folder)
        complete = from_rank_0(failure is None if self.rank == 0 else None, self.group)
        if failure is None and not complete:
            failure = _failed_elsewhere(self.folder)
        return failure

    def _write_files(self) -> None:
        if self.shared is not None:
            saves.write_part(self.folder, saves.SHARED, _torch_save(self.shared))
        saves.write_part(self.folder, saves.rank_file(self.rank), _torch_save(self.own))


def _failed_elsewhere(folder: Path) -> CheckpointError:
    return CheckpointError(
        f"The save {folder} failed on another rank.",
        hint="See that rank's error; the previous complete save is still there.",
    )


def _torch_save(obj: Any) -> Any:
    def write(handle: Any) -> None:
        torch.save(obj, handle)

    return write
