"""One save's writing: each rank's files, the ranks' meeting, then rank 0's marker.

Run by the training state's background thread (or inline for a blocking save). Every rank writes
its shards of a sharded model (DCP, into ``sharded/``), then its files, then all ranks meet (an
all-reduce of "my part is on disk" in the saves' own gloo group, where DCP meets too, so that a
rank whose write failed does not leave the others waiting); only when all parts are there does
rank 0 mark the save complete and remove the saves beyond ``keep``. A failed save is removed,
and the error raised to whoever waits for the save.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gpukit.train._sharded_part as _sharded_part
import gpukit.train.saves as saves
from gpukit.errors import CheckpointError

__all__ = ["SaveJob"]


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
                _sharded_part.write(self.folder / saves.SHARDED, self.sharded, self.group)
                # This rank's file, and on rank 0 the .metadata DCP renamed in.
                saves.fsync_folder(self.folder / saves.SHARDED)
            except BaseException as exc:  # every rank has it: DCP told them all
                failure = exc
            self.sharded = None
        try:
            if failure is None:
                self._write_files()
        except BaseException as exc:  # reported after all ranks know, so none waits forever
            failure = exc
        self.shared = None  # the host copies are not needed any more
        if self.world > 1:
            ok = torch.tensor([0 if failure is not None else 1], dtype=torch.int64)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
            if failure is None and int(ok.item()) == 0:
                failure = CheckpointError(
                    f"The save {self.folder} failed on another rank.",
                    hint="See that rank's error; the previous complete save is still there.",
                )
        if failure is not None:
            if self.rank == 0:
                with contextlib.suppress(OSError):
                    saves.remove(self.folder)  # nothing half-written is left behind
            if isinstance(failure, OSError):
                raise CheckpointError(
                    f"Cannot write the save {self.folder}: {failure.strerror}.",
                    hint="Free space or fix the folder's permissions; the previous complete "
                    "save is still there.",
                ) from failure
            raise failure
        if self.rank == 0:
            saves.finish(self.folder, step=self.step, world_size=self.world)
            saves.prune(self.folder.parent, keep=self.keep, current=self.folder)
        return self.folder

    def _write_files(self) -> None:
        if self.shared is not None:
            saves.write_part(self.folder, saves.SHARED, _torch_save(self.shared))
        saves.write_part(self.folder, saves.rank_file(self.rank), _torch_save(self.own))


def _torch_save(obj: Any) -> Any:
    def write(handle: Any) -> None:
        torch.save(obj, handle)

    return write
