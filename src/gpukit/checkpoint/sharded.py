"""Sharded checkpoint folders in Hugging Face's layout: an index JSON and one file per shard.

The index (``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``) holds
``{"metadata": {"total_size": N}, "weight_map": {key: shard file name}}``; the shards are named
``model-00001-of-00003.safetensors`` (``pytorch_model-00001-of-00003.bin``). Every shard is
checked before anything is loaded: a missing or cut-short shard, or one whose keys disagree with
the index, is a :class:`~gpukit.errors.CheckpointError` naming the files. Loading then reads one
shard at a time (safetensors memory-mapped) straight into the model's tensors.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpukit import untrusted
from gpukit.checkpoint.paths import fd_path, fs_error, open_content
from gpukit.checkpoint.safetensors_format import DTYPES, write_safetensors
from gpukit.checkpoint.source import Location, shape_only
from gpukit.errors import CheckpointError
from gpukit.untrusted import InvalidInput

__all__ = [
    "HEADER_LIMIT",
    "INDEX_LIMIT",
    "INDEX_NAMES",
    "SAFETENSORS_INDEX",
    "ShardedFolder",
    "open_index",
    "plan_shards",
    "read_index",
    "shard_names",
    "write_shards",
]

SAFETENSORS_INDEX = "model.safetensors.index.json"
INDEX_NAMES = {SAFETENSORS_INDEX: "safetensors", "pytorch_model.bin.index.json": "torch"}
_FROM_CODE = {code: dtype for dtype, code in DTYPES.items()}
HEADER_LIMIT = 100_000_000
"""The largest safetensors header read: safetensors itself refuses larger ones."""
INDEX_LIMIT = 100_000_000
"""The largest index file read (a 400B-parameter model's is a few megabytes)."""
_MAX_ENTRIES = 1 << 22
_MAX_DIMS = 64


@dataclass
class Shard:
    """One shard file: the keys the index assigns to it and, once read, what it holds."""

    path: Path
    keys: list[str]
    size: int = 0
    tensors: dict[str, tuple[list[int], torch.dtype]] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class ShardedFolder:
    """A checked sharded folder: the :class:`~gpukit.checkpoint.source.Source` of its layout.

    ``content`` holds every stored key with a shape-only tensor, in the index's order of
    shards; a tensor's stored key is its key there. Nothing is read until :meth:`read_into`.
    """

    path: Path
    index_path: Path
    shard_format: str  # "safetensors" or "torch"
    shards: list[Shard]
    total_size: int | None
    index_size: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    content: dict[str, torch.Tensor] = field(default_factory=dict)
    layout: str = field(default="sharded", init=False)

    @property
    def format(self) -> str:
        """``"sharded safetensors"`` or ``"sharded torch"``."""
        return f"sharded {self.shard_format}"

    @property
    def index(self) -> str:
        """The index file's name."""
        return self.index_path.name

    @property
    def files(self) -> dict[str, int]:
        """Every shard with its size, then the index."""
        found = {shard.path.name: shard.size for shard in self.shards}
        found[self.index] = self.index_size
        return found

    @property
    def size(self) -> int:
        """Bytes of the shards and the index."""
        return sum(self.files.values())

    @property
    def source_devices(self) -> list[str]:
        """The devices gk.save recorded the tensors were on (none for other writers)."""
        return [str(d) for d in self.metadata.get("devices", [])]

    @property
    def tensors(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """Every stored key with its shape and dtype, in the index's order of shards."""
        found: dict[str, tuple[list[int], torch.dtype]] = {}
        for shard in self.shards:
            found.update(shard.tensors)
        return found

    def saved_device(self, tensor: torch.Tensor) -> str | None:
        """The device the tensors were saved from, when every one came from the same."""
        return self.source_devices[0] if len(self.source_devices) == 1 else None

    def stored_key(self, location: Location) -> str:
        """The key itself: the folder's content is one flat state dict."""
        (key,) = location
        return key

    def read_into(self, targets: Mapping[str, list[torch.Tensor]], *, trust: bool) -> None:
        """Copy each stored tensor into its targets, one shard in memory at a time."""
        for shard in self.shards:
            wanted = [key for key in shard.keys if key in targets]
            if wanted:
                _read_shard(self, shard, wanted, targets, trust)

    def read_extras(
        self, names: Collection[str], *, trust: bool
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Nothing: a sharded folder holds only weights."""
        return {}, {}

    def read_content(
        self, *, trust: bool, only: Collection[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Every stored tensor (``only``: those keys), on the CPU."""
        tensors = {k: v for k, v in self.tensors.items() if only is None or k in only}
        out = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in tensors.items()}
        self.read_into({key: [value] for key, value in out.items()}, trust=trust)
        return out


def _bad_index(index: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{index} is not a usable checkpoint index: {what}.",
        hint='An index holds {"weight_map": {key: shard file name}} next to its shards; '
        "save or download the folder again.",
    )


def read_index(index: Path) -> dict[str, Any]:
    """The parsed index file (bounded, depth-checked JSON object), or a CheckpointError."""
    fd = open_content(index, folder=index.parent)
    try:
        data = untrusted.parse_json(untrusted.read_bounded(fd, INDEX_LIMIT), limit=INDEX_LIMIT)
    except OSError as exc:
        raise fs_error(index, exc, "read") from None
    except InvalidInput as exc:
        raise _bad_index(index, f"it is not an index gpukit reads ({exc})") from None
    finally:
        os.close(fd)
    if type(data) is not dict:
        raise _bad_index(index, "it is not a JSON object")
    return data


def open_index(index: Path, *, trust: bool, data: dict[str, Any] | None = None) -> ShardedFolder:
    """Check an index file and every shard it names (headers only for safetensors).

    ``data``: the index, already read and parsed (by whoever recognised the file as one), so
    that it is read once; read here when not given.
    """
    if data is None:
        data = read_index(index)
    try:
        weight_map = untrusted.as_dict(data.get("weight_map"), limit=_MAX_ENTRIES)
    except InvalidInput:
        raise _bad_index(index, "it has no weight_map") from None
    if not weight_map:
        raise _bad_index(index, "it has no weight_map")
    by_file: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        # Shard names are plain file names next to the index: never a path elsewhere.
        if (
            type(name) is not str
            or not name
            or len(name) > 255
            or "/" in name
            or "\\" in name
            or not name.isprintable()
            or name in {".", ".."}
        ):
            shown = untrusted.printable(name) if type(name) is str else type(name).__name__
            raise _bad_index(index, f"{key!r} points at {shown!r}, not a file next to the index")
        by_file.setdefault(name, []).append(key)
    meta = data.get("metadata")
    total = meta.get("total_size") if type(meta) is dict else None
    fmt = INDEX_NAMES.get(index.name) or _format_of_names(list(by_file))
    shards = [Shard(index.parent / name, keys) for name, keys in sorted(by_file.items())]
    folder = ShardedFolder(
        index.parent, index, fmt, shards, total if type(total) is int and total >= 0 else None
    )
    for shard in shards:
        shard.size = _check_shard_file(folder, shard)
        if fmt == "safetensors":
            shard.tensors, shard.metadata = _safetensors_header(shard.path, shard.size)
        else:
            shard.tensors = {
                key: (list(value.shape), value.dtype)
                for key, value in _load_torch_shard(shard.path, trust).items()
                if isinstance(value, torch.Tensor)
            }
        lacking = [key for key in shard.keys if key not in shard.tensors]
        if lacking:
            shown = ", ".join(repr(key) for key in lacking[:4])
            more = f" and {len(lacking) - 4} more" if len(lacking) > 4 else ""
            raise CheckpointError(
                f"{shard.path} does not match {index}: the index puts {shown}{more} in that "
                "shard, and the shard does not hold them.",
                hint="The folder mixes files of different saves; save or download it again.",
            )
    folder.index_size = index.stat().st_size
    folder.content = {key: shape_only(*found) for key, found in folder.tensors.items()}
    if shards:
        from gpukit.checkpoint.single_file import gpukit_metadata

        folder.metadata = gpukit_metadata({}, shards[0].metadata)
    return folder


def _format_of_names(names: list[str]) -> str:
    return "safetensors" if all(name.endswith(".safetensors") for name in names) else "torch"


def _check_shard_file(folder: ShardedFolder, shard: Shard) -> int:
    if not shard.path.exists() and not shard.path.is_symlink():
        raise CheckpointError(
            f"{shard.path} is missing: {folder.index_path} lists it as a shard of this checkpoint.",
            hint="Copy or download the whole folder again; every shard is needed.",
        )
    fd = open_content(shard.path, folder=folder.path)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _cut_short(path: Path, size: int, needed: int) -> CheckpointError:
    return CheckpointError(
        f"{path} ({size} bytes) is a safetensors shard cut short: its header needs {needed} bytes.",
        hint="The shard is truncated (an interrupted copy or download); fetch it again.",
    )


def _malformed(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path} has a malformed safetensors header: {what}.",
        hint="Fetch the shard again, or convert it with safetensors' own tools.",
    )


def _read_exactly(fd: int, count: int) -> bytes:
    chunks: list[bytes] = []
    left = count
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _safetensors_header(
    path: Path, size: int
) -> tuple[dict[str, tuple[list[int], torch.dtype]], dict[str, str]]:
    """A shard's tensors (shape, dtype) and metadata, from its header, every field checked:
    a known dtype, a shape of non-negative sizes whose bytes are exactly the tensor's span of
    the data, and that span inside the file."""
    fd = open_content(path, folder=path.parent)
    try:
        head = _read_exactly(fd, 8)
        if len(head) < 8:
            raise _cut_short(path, size, 8)
        (length,) = struct.unpack("<Q", head)
        if length > HEADER_LIMIT:
            raise _malformed(path, f"it claims {length} bytes, more than {HEADER_LIMIT}")
        if 8 + length > size:
            raise _cut_short(path, size, 8 + length)
        raw = _read_exactly(fd, length)
    except OSError as exc:
        raise fs_error(path, exc, "read") from None
    finally:
        os.close(fd)
    if len(raw) < length:
        raise _cut_short(path, size, 8 + length)
    try:
        header = untrusted.as_dict(untrusted.parse_json(raw, limit=length), limit=_MAX_ENTRIES)
        metadata = _header_metadata(header.pop("__metadata__", None))
    except InvalidInput as exc:
        raise CheckpointError(
            f"{path} is not a safetensors file gpukit reads: its header is refused ({exc}).",
            hint="The shard is corrupted or of another format; fetch it again.",
        ) from None
    tensors: dict[str, tuple[list[int], torch.dtype]] = {}
    end = 0
    for key, info in header.items():
        try:
            tensors[key], stop = _header_entry(info)
        except InvalidInput as exc:
            raise CheckpointError(
                f"{path} has a malformed or unsupported safetensors entry for {key!r} ({exc}).",
                hint="Fetch the shard again, or convert it with safetensors' own tools.",
            ) from None
        end = max(end, stop)
    if 8 + length + end > size:
        raise _cut_short(path, size, 8 + length + end)
    return tensors, metadata


def _header_metadata(value: object) -> dict[str, str]:
    if value is None:
        return {}
    found = untrusted.as_dict(value, what="__metadata__")
    for text in found.values():
        untrusted.as_str(text, limit=HEADER_LIMIT, what="a __metadata__ value")
    return dict(found)


def _header_entry(info: object) -> tuple[tuple[list[int], torch.dtype], int]:
    """One header entry's (shape, dtype) and the end of its data, or InvalidInput."""
    entry = untrusted.as_dict(info, what="the entry")
    dtype = _FROM_CODE.get(untrusted.as_str(entry.get("dtype"), limit=16, what="dtype"))
    if dtype is None:
        raise InvalidInput("its dtype is not one gpukit knows")
    shape = [
        untrusted.as_int(n, high=1 << 62, what="a size")
        for n in untrusted.as_list(entry.get("shape"), limit=_MAX_DIMS, what="shape")
    ]
    offsets = untrusted.as_list(entry.get("data_offsets"), limit=2, what="data_offsets")
    if len(offsets) != 2:
        raise InvalidInput("data_offsets is not [begin, end]")
    begin, stop = (untrusted.as_int(n, high=1 << 62, what="an offset") for n in offsets)
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
        if nbytes > stop:
            break
    if begin > stop or nbytes != stop - begin:
        raise InvalidInput("its shape and dtype do not match its data_offsets")
    return (shape, dtype), stop


def _load_torch_shard(path: Path, trust: bool) -> dict[str, Any]:
    from gpukit.checkpoint.single_file import TORCH, unreadable_error, untrusted_error

    fd = open_content(path, folder=path.parent)
    try:
        # mmap: the shard's tensors stay on disk until copied, one shard at a time. The name
        # given is that of the file already opened and checked.
        loaded = torch.load(
            fd_path(fd, path), map_location="cpu", mmap=True, weights_only=not trust
        )
    except Exception as exc:
        if not trust and "Weights only load failed" in str(exc):
            raise untrusted_error(path, exc) from None
        raise unreadable_error(path, TORCH, exc) from None
    finally:
        os.close(fd)
    if not isinstance(loaded, dict):
        raise CheckpointError(
            f"{path} holds a {type(loaded).__name__}, not a shard (a dict of tensors).",
            hint="The folder mixes files of different kinds; save or download it again.",
        )
    return loaded


def _read_shard(
    folder: ShardedFolder,
    shard: Shard,
    wanted: list[str],
    targets: Mapping[str, list[torch.Tensor]],
    trust: bool,
) -> None:
    with torch.no_grad():
        if folder.shard_format == "safetensors":
            from safetensors import safe_open

            fd = open_content(shard.path, folder=folder.path)
            try:
                with safe_open(fd_path(fd, shard.path), framework="pt", device="cpu") as handle:
                    for key in wanted:
                        value = handle.get_tensor(key)
                        for target in targets[key]:
                            target.copy_(value)
                        del value
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own (Rust) error types
                reason = (str(exc).splitlines() or [type(exc).__name__])[0]
                raise CheckpointError(
                    f"{shard.path} cannot be read ({reason}).",
                    hint="The shard is probably corrupted; fetch it again.",
                ) from None
            finally:
                os.close(fd)
            return
        state = _load_torch_shard(shard.path, trust)
        for key in wanted:
            for target in targets[key]:
                target.copy_(state[key])
        del state


def shard_names(count: int, fmt: str = "safetensors") -> list[str]:
    """Hugging Face's shard file names: ``model-00001-of-00002.safetensors``, ..."""
    stem, suffix = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    return [f"{stem}-{i:05d}-of-{count:05d}.{suffix}" for i in range(1, count + 1)]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def plan_shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Keys grouped into shards in order, each at most ``max_bytes`` unless one tensor is larger."""
    shards: list[list[str]] = [[]]
    used = 0
    for key, tensor in tensors.items():
        size = _nbytes(tensor)
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += size
    return shards


def write_shards(
    folder: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    max_bytes: int,
    write_file: Callable[[Path, Callable[[Any], None]], None],
) -> None:
    """Write the shards and the index into ``folder`` (an empty temporary folder).

    ``write_file(path, writer)`` writes one file durably; the index comes last, so a folder
    with an index has all its shards.
    """
    groups = plan_shards(tensors, max_bytes)
    names = shard_names(len(groups))
    weight_map: dict[str, str] = {}
    for name, keys in zip(names, groups, strict=True):
        part = {key: tensors[key] for key in keys}

        def write(handle: Any, part: dict[str, torch.Tensor] = part) -> None:
            write_safetensors(handle, part, metadata)

        write_file(folder / name, write)
        weight_map.update(dict.fromkeys(keys, name))
    index = {
        "metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    encoded = (json.dumps(index, indent=2) + "\n").encode()
    write_file(folder / SAFETENSORS_INDEX, lambda handle: handle.write(encoded))
