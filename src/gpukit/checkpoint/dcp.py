"""torch.distributed.checkpoint (DCP) folders: read checked on one process, written by every rank.

A DCP folder (written by ``torch.distributed.checkpoint.save``, FSDP, torchtitan) holds a
``.metadata`` pickle that lists every entry, its shape and which ``*.distcp`` file holds each
chunk. That pickle is a stranger's file: :mod:`gpukit.checkpoint.dcp_metadata` reads it without
running code and hands over a checked, rebuilt copy. The tensors themselves are then read by
torch's own planner, straight into the given tensors, one file at a time, through data files
opened by :func:`~gpukit.checkpoint.paths.open_content`.

:func:`write_dcp` is gpukit's one writer of such folders: ``gk.save`` of a sharded model and the
sharded part of a training state both write through it.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpukit import untrusted
from gpukit._agree import all_true
from gpukit.checkpoint.atomic import fsync_folder
from gpukit.checkpoint.dcp_metadata import read_metadata, set_path
from gpukit.checkpoint.paths import open_content
from gpukit.checkpoint.source import Location, StoredObject, shape_only
from gpukit.errors import CheckpointError

__all__ = ["METADATA_NAME", "DcpFolder", "is_dcp_folder", "open_dcp", "write_dcp"]

METADATA_NAME = ".metadata"


def is_dcp_folder(folder: Path) -> bool:
    """A folder with DCP's ``.metadata`` file."""
    return (folder / METADATA_NAME).is_file()


@dataclass
class DcpFolder:
    """A checked DCP folder: the :class:`~gpukit.checkpoint.source.Source` of DCP's layout.

    ``checked`` is the folder's ``.metadata``, checked and rebuilt; ``content`` is the nested
    structure that was saved (each entry put where the planner's path says), tensors
    shape-only, other entries :class:`~gpukit.checkpoint.source.StoredObject`. A tensor's
    stored key is DCP's own flattened name (``"model.0.weight"``).
    """

    path: Path
    checked: Any
    data_files: dict[str, int] = field(default_factory=dict)  # data file name -> size
    metadata_size: int = 0
    content: dict[str, Any] = field(default_factory=dict)
    _key_at: dict[Location, str] = field(default_factory=dict, repr=False)
    format: str = field(default="dcp", init=False)
    layout: str = field(default="dcp", init=False)
    index: str = field(default=METADATA_NAME, init=False)
    metadata: dict[str, Any] = field(default_factory=dict, init=False)  # gk.save writes no DCP
    source_devices: list[str] = field(default_factory=list, init=False)

    @property
    def files(self) -> dict[str, int]:
        """Every data file with its size, then ``.metadata``."""
        return {**self.data_files, METADATA_NAME: self.metadata_size}

    @property
    def size(self) -> int:
        """Bytes of the data files and ``.metadata``."""
        return sum(self.files.values())

    def saved_device(self, tensor: torch.Tensor) -> str | None:
        """Unknown: DCP does not record where the tensors were."""
        return None

    def stored_key(self, location: Location) -> str:
        """DCP's flattened name of the entry the planner put at ``location``."""
        return self._key_at[location]

    def read_extras(
        self, names: Collection[str], *, trust: bool
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The top-level entries ``names``, read on the CPU (a pickle is refused, not skipped)."""
        return self.read_content(trust=trust, only=set(names)), {}

    @property
    def tensors(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """Every tensor entry (flattened key) with its full shape and dtype."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return {
            key: (list(item.size), item.properties.dtype)
            for key, item in self.checked.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
        }

    def path_of(self, key: str) -> tuple[Any, ...]:
        """Where ``key`` sat in the saved nested dict: ``("model", "0.weight")``."""
        found: tuple[Any, ...] = self.checked.planner_data.get(key, (key,))
        return found

    def _reader(self) -> Any:
        from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

        checked = self.checked
        folder = self.path
        refused: list[CheckpointError] = []

        class _CheckedFileSystem(FileSystem):
            # Data files opened as every checkpoint file is: regular, never blocking, links
            # only within the folder. torch wraps what this raises, so the error is kept.
            @contextlib.contextmanager
            def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
                try:
                    fd = open_content(Path(path), folder=folder)
                except CheckpointError as exc:
                    refused.append(exc)
                    raise
                with os.fdopen(fd, "rb") as stream:
                    yield stream

        class _CheckedReader(FileSystemReader):
            # torch's reader unpickles .metadata with plain pickle; it gets the checked copy.
            refused: list[CheckpointError]

            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                return checked

        reader = _CheckedReader(str(folder))
        reader.fs = _CheckedFileSystem()
        reader.refused = refused
        return reader

    def read_into(self, targets: Mapping[str, list[torch.Tensor]], *, trust: bool) -> None:
        """Copy each tensor entry into its targets, through torch's DCP planner, in place."""
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        first = {key: tensors[0].detach() for key, tensors in targets.items() if tensors}
        with torch.no_grad(), warnings.catch_warnings():
            # One process without a process group is exactly what is meant here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            reader = self._reader()
            try:
                dcp_load(first, storage_reader=reader, no_dist=True)
            except CheckpointError:
                raise
            except (Exception, CheckpointException) as exc:  # torch wraps reader errors
                raise self._failure(exc, reader.refused) from None
            for tensors in targets.values():
                for extra in tensors[1:]:
                    extra.copy_(tensors[0])

    def load(self, state_dict: dict[str, Any], *, process_group: Any = None) -> None:
        """Read the folder into ``state_dict`` in place, as ``torch.distributed.checkpoint.load``.

        With ``process_group`` every rank of it calls this at once; each reads only the chunks
        its own tensors need (a DTensor's shards, or whole tensors), whatever number of
        processes saved the folder. Without one, this process reads alone. Entries other than
        tensors are read as data (``weights_only``): torch's own planner unpickles them with
        ``weights_only=False``.

        Raises:
            CheckpointError: ``state_dict`` has entries the folder lacks or holds in another
                shape (before anything is read), or a file cannot be read (on every rank).
        """
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        flat, _ = flatten_state_dict(state_dict)
        wrong = self._mismatches(flat)
        if wrong:  # every rank has the same keys and shapes: each refuses alike, none waits
            raise CheckpointError(
                f"{self.path} does not fit the state it is loaded into: {len(wrong)} "
                f"mismatch{'es' if len(wrong) > 1 else ''} ({'; '.join(wrong[:3])}).",
                hint="Load it into the model and optimizer that saved it.",
            )
        reader = self._reader()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp_load(
                    state_dict,
                    storage_reader=reader,
                    planner=_data_planner(self.path, reader.refused),
                    process_group=process_group,
                    no_dist=process_group is None,
                )
            except CheckpointError:
                raise
            except (Exception, CheckpointException) as exc:
                raise self._failure(exc, reader.refused) from None

    def _mismatches(self, flat: Mapping[str, Any]) -> list[str]:
        """What of a flattened state dict the folder lacks, or holds in another shape."""
        stored = self.checked.state_dict_metadata
        tensors = self.tensors
        wrong: list[str] = []
        for key, value in flat.items():
            if key not in stored:
                wrong.append(f"{untrusted.printable(key)} is not in it")
            elif isinstance(value, torch.Tensor) and (
                key not in tensors or tensors[key][0] != list(value.shape)
            ):
                saved = tensors[key][0] if key in tensors else "not a tensor"
                wrong.append(f"{key} is {saved} there, {list(value.shape)} here")
        return wrong

    def _failure(self, exc: BaseException, refused: list[CheckpointError]) -> CheckpointError:
        if refused:
            return refused[0]
        return CheckpointError(
            f"{self.path} cannot be read as a DCP checkpoint ({_reason(exc)}).",
            hint="A data file is probably truncated or corrupted; copy the folder again.",
        )

    def read_content(self, *, trust: bool, only: Collection[str] | None = None) -> dict[str, Any]:
        """The saved nested dict, tensors on the CPU (the whole checkpoint in memory).

        ``only`` reads just the entries under those top-level keys, so that what is not wanted
        (an optimizer's pickled state) is never unpickled. Non-tensor entries are pickles inside
        the data files: read with ``weights_only`` unless ``trust``.
        """
        wanted = [
            k
            for k in self.checked.state_dict_metadata
            if only is None or self.path_of(k)[0] in only
        ]
        shapes = self.tensors
        try:
            tensors = {
                key: torch.empty(shapes[key][0], dtype=shapes[key][1])
                for key in wanted
                if key in shapes
            }
        except (RuntimeError, MemoryError):  # sizes are checked; memory may still lack
            raise CheckpointError(
                f"{self.path} does not fit in memory: its tensors need "
                f"{sum(_bytes_of(*shapes[k]) for k in wanted if k in shapes)} bytes.",
                hint="Free some memory, or read it on a machine with more.",
            ) from None
        if tensors:
            self.read_into({key: [value] for key, value in tensors.items()}, trust=trust)
        flat: dict[str, Any] = dict(tensors)
        flat.update(self._read_objects(set(wanted), trust))
        nested: dict[str, Any] = {}
        for key in wanted:
            if key in flat:
                set_path(nested, self.path_of(key), flat[key])
        return nested

    def _read_objects(self, wanted: set[str], trust: bool) -> dict[str, Any]:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        objects: dict[str, Any] = {}
        for index, info in self.checked.storage_data.items():
            item = self.checked.state_dict_metadata.get(index.fqn)
            if index.fqn not in wanted or not isinstance(item, BytesStorageMetadata):
                continue
            path = self.path / info.relative_path
            with os.fdopen(open_content(path, folder=self.path), "rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
            try:
                objects[index.fqn] = torch.load(io.BytesIO(data), weights_only=not trust)
            except pickle.UnpicklingError as exc:
                from gpukit.checkpoint.single_file import untrusted_error

                if not trust and "Weights only load failed" in str(exc):
                    raise untrusted_error(path, exc) from None
                raise _damaged_entry(path, index.fqn) from None
            except Exception:  # whatever torch's readers raise on damaged bytes
                raise _damaged_entry(path, index.fqn) from None
        return objects


def _data_planner(folder: Path, refused: list[CheckpointError]) -> Any:
    """DCP's default load planner, reading each entry other than a tensor as data."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class _DataPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            key = read_item.dest_index.fqn
            try:
                found = torch.load(value, weights_only=True)
            except Exception:  # torch wraps it: the reason is kept for the caller
                refused.append(
                    CheckpointError(
                        f"{folder} cannot be read: the entry {key!r} is not plain data, or "
                        "its bytes are damaged.",
                        hint="The checkpoint was changed after it was written; copy it again.",
                    )
                )
                raise
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[key], found)
            else:
                self.state_dict[key] = found

    return _DataPlanner()


def _bytes_of(shape: list[int], dtype: torch.dtype) -> int:
    count = dtype.itemsize
    for n in shape:
        count *= n
    return count


def _reason(exc: BaseException) -> str:
    """What went wrong, in a few words: the first failure a CheckpointException wraps."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))  # (exception, traceback) per rank
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            exc = inner[0]
    first = (str(exc).split(". ")[0].splitlines() or [""])[0]
    return (
        untrusted.printable(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)
        or "?"
    )


def _damaged_entry(path: Path, key: str) -> CheckpointError:
    return CheckpointError(
        f"{path} cannot be read: the bytes of entry {key!r} are damaged.",
        hint="The data file is probably truncated or corrupted; copy the folder again.",
    )


def open_dcp(folder: Path) -> DcpFolder:
    """Read and check a DCP folder's metadata and data files (names, presence, lengths)."""
    metadata = read_metadata(folder / METADATA_NAME)
    found = DcpFolder(folder, metadata)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        path = folder / name
        if not path.exists() and not path.is_symlink():
            raise CheckpointError(
                f"{path} is missing: {folder / METADATA_NAME} lists it as a data file of this "
                "checkpoint.",
                hint="Copy the whole folder again; every .distcp file is needed.",
            )
        fd = open_content(path, folder=folder)
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size < end:
            raise CheckpointError(
                f"{path} ({size} bytes) is cut short: {folder / METADATA_NAME} places data up to "
                f"byte {end}.",
                hint="The file is truncated (an interrupted copy); copy the folder again.",
            )
        found.data_files[name] = size
    found.metadata_size = (folder / METADATA_NAME).stat().st_size
    tensors = found.tensors
    for key in metadata.state_dict_metadata:
        place = found.path_of(key)
        value = shape_only(*tensors[key]) if key in tensors else StoredObject()
        set_path(found.content, place, value)
        found._key_at[tuple(str(step) for step in place)] = key
    return found


_WRITE_HINT = (
    "Free space or fix the folder's permissions, then save again; what was saved before is "
    "left as it was."
)


def write_dcp(
    folder: Path, state: Mapping[str, Any], *, group: Any = None, target: Path | None = None
) -> None:
    """Write ``state`` into ``folder`` as a DCP checkpoint, on every rank of ``group`` at once.

    Each rank writes only its own part (a DTensor's local shards; plain tensors and other
    entries once) into its own file and fsyncs it; the coordinator (rank 0 of ``group``)
    writes ``.metadata`` once it heard from every rank; then every rank fsyncs ``folder``, so
    that the entries it made are durable too. Once this returns on any rank, the whole folder
    is on disk. Without a process group this process writes alone. Nothing is gathered: no rank
    holds more than its own shards.

    Args:
        folder: an empty folder every rank can write (on a file system the ranks share).
        state: the nested state dict to write (``get_state_dict``'s, or any DCP accepts).
        group: the process group whose ranks all call this; ``None``: the default group.
        target: the path the errors name, where ``folder`` is a temporary folder built for it.

    Raises:
        CheckpointError: a rank could not write its part: raised on every rank, which DCP
            tells (before any rank writes, where a rank cannot even set up its writer); or
            this rank could not fsync ``folder``: raised here alone, for the caller's meeting
            of the ranks to tell the others.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    shown = folder if target is None else target
    reason = ""
    try:
        # One file a rank (``__<rank>_0.distcp``), written even where the rank holds no shard:
        # a training state's marker names exactly these.
        writer = FileSystemWriter(
            folder, single_file_per_rank=True, thread_count=1, sync_files=True, overwrite=False
        )
    except OSError as exc:
        reason = exc.strerror or str(exc)
    # Every rank enters DCP's collectives, or none does: a rank that cannot write is not waited for.
    if not all_true(not reason, group):
        raise CheckpointError(
            f"Cannot write the DCP checkpoint {shown}: {reason or 'it failed on another rank'}.",
            hint=_WRITE_HINT,
        )
    try:
        alone = not dist.is_initialized()
        dcp_save(dict(state), storage_writer=writer, process_group=group, no_dist=alone)
        fsync_folder(folder)
    except (Exception, CheckpointException) as exc:  # DCP raises a rank's failure on every rank
        raise CheckpointError(
            f"Cannot write the DCP checkpoint {shown}: {_reason(exc)}.", hint=_WRITE_HINT
        ) from None
