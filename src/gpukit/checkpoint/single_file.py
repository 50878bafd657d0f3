"""Checkpoint files: format detection by content, and reading without raw tracebacks.

The format is read from the first bytes, never from the name: a torch.save file named
``.safetensors`` loads as what it is. (Atomic writing lives in ``atomic``.)
"""

from __future__ import annotations

import codecs
import contextlib
import os
import pickle
import re
import stat
import struct
import zipfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpukit import untrusted
from gpukit.checkpoint.keys import unwrap
from gpukit.checkpoint.paths import check_input, fd_path, open_content
from gpukit.checkpoint.source import Location
from gpukit.errors import CheckpointError, InvalidArgumentError, UntrustedCheckpointError

__all__ = [
    "SingleFile",
    "file_format",
    "gpukit_metadata",
    "read",
    "suffix_format",
    "unreadable_error",
    "untrusted_error",
]

SAFETENSORS = "safetensors"
TORCH = "torch"
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def suffix_format(path: Path) -> str:
    """``"safetensors"`` or ``"torch"`` from a file name; anything else is a usage error."""
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return SAFETENSORS
    if suffix in TORCH_SUFFIXES:
        return TORCH
    raise InvalidArgumentError(
        f"{path.name}: gpukit picks the checkpoint layout from the suffix, and "
        f"{suffix or 'no suffix'!r} is not one it knows.",
        hint="Name the file *.safetensors (weights only) or *.pt / *.pth (anything torch.save "
        "can hold), or give no suffix for a sharded folder.",
    )


def _safetensors_header(head: bytes, limit: int = 100 << 20) -> bool:
    """An 8-byte header length (safetensors caps headers at 100 MB) followed by JSON."""
    if len(head) < 9:
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return 0 < length <= limit and head[8:9] == b"{"


def file_format(path: Path, *, folder: Path | None = None) -> str:
    """What the bytes of ``path`` are: ``safetensors``, ``torch`` (zip or legacy), or a guess.

    Anything but the first two is a short description used in error messages (``empty``,
    ``text``, ``zip archive``, ``unknown``). ``folder``: the checkpoint folder ``path`` is
    part of (its links must stay inside it, see :func:`~gpukit.checkpoint.paths.open_content`).
    """
    fd = open_content(path, folder=folder)
    try:
        size = os.fstat(fd).st_size
        head = os.read(fd, 64)
    finally:
        os.close(fd)
    if size == 0:
        return "empty"
    if head.startswith(b"PK\x03\x04"):
        return TORCH
    if _safetensors_header(head):
        return SAFETENSORS
    if head[:1] == b"\x80":  # a pickle protocol marker: torch's legacy format
        return TORCH
    if head.startswith((b"\x93NUMPY", b"\x89HDF")):
        return "numpy or HDF5 data"
    try:
        # Incremental: the 64 bytes may end inside a character, which is still text.
        codecs.getincrementaldecoder("utf-8")().decode(head)
    except UnicodeDecodeError:
        return "unknown binary data"
    return "text"


@dataclass
class SingleFile:
    """One checkpoint file, read whole: the :class:`~gpukit.checkpoint.source.Source` of a file.

    ``content`` is what the file holds, before any key cleaning, its tensors real (on the
    device it was read onto). A pickle has no keys of its own: a tensor's stored key is its
    location in ``content``, written as the tuple it is (``"('model', 'fc.weight')"``).
    """

    path: Path
    format: str
    content: Any
    source_devices: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    size: int = 0
    _by_pointer: dict[int, str] = field(default_factory=dict, repr=False)
    layout: str = field(default="file", init=False)
    files: dict[str, int] = field(default_factory=dict, init=False)
    index: str | None = field(default=None, init=False)
    _located: dict[str, Location] = field(default_factory=dict, init=False, repr=False)

    def saved_device(self, tensor: torch.Tensor) -> str | None:
        """The device ``tensor`` was saved from, when the file says so (None: unknown)."""
        if len(self.source_devices) == 1:
            return self.source_devices[0]
        return self._by_pointer.get(tensor.untyped_storage().data_ptr())

    def stored_key(self, location: Location) -> str:
        """The tensor's place in ``content``, as the tuple it is (one key per place)."""
        key = repr(location)
        self._located[key] = location
        return key

    def read_into(self, targets: Mapping[str, list[torch.Tensor]], *, trust: bool) -> None:
        """Copy each stored key's tensor (already in memory) into its targets."""
        parents: dict[Location, Any] = {}
        with torch.no_grad():
            for key, tensors in targets.items():
                location = self._located[key]
                parent = parents.get(location[:-1])
                if parent is None:
                    parent = _entry(self.content, location[:-1])
                    if isinstance(parent, nn.Module):  # a pickled module: its state dict,
                        parent = unwrap(parent)[0].state_dict()  # once for all its tensors
                    parents[location[:-1]] = parent
                value = _entry(parent, location[-1:])
                for tensor in tensors:
                    tensor.copy_(value)

    def read_extras(
        self, names: Collection[str], *, trust: bool
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The top-level entries ``names``, as read with the file (nothing is left unread)."""
        if not names or not isinstance(self.content, Mapping):
            return {}, {}
        wanted = set(names)
        return {str(k): v for k, v in self.content.items() if str(k) in wanted}, {}

    def read_content(self, *, trust: bool, only: Collection[str] | None = None) -> Any:
        """``content`` (read already), or just its top-level entries ``only``."""
        if only is None or not isinstance(self.content, Mapping):
            return self.content
        wanted = set(only)
        return {k: v for k, v in self.content.items() if str(k) in wanted}


def _entry(node: Any, location: Location) -> Any:
    """The entry at ``location`` under ``node`` (mappings all the way down)."""
    for step in location:
        if step not in node:  # a key the weights finder named by its str(), as an int
            step = next(k for k in node if str(k) == step)
        node = node[step]
    return node


class _LocationRecorder:
    """A torch.load ``map_location`` that notes each storage's saved device, then moves it."""

    def __init__(self, target: torch.device | None) -> None:
        self.target = target
        self.seen: list[str] = []
        self.by_pointer: dict[int, str] = {}

    def __call__(self, storage: Any, location: str) -> Any:
        if location not in self.seen:
            self.seen.append(location)
        if self.target is None or self.target.type == "cpu":
            # torch hands the storage over on the CPU; kept as is, so its address names it.
            self.by_pointer[storage.data_ptr()] = location
            return storage
        restore = torch.serialization.default_restore_location
        return restore(storage, str(self.target))  # type: ignore[no-untyped-call]


def untrusted_error(path: Path, exc: Exception) -> UntrustedCheckpointError:
    """The error for a pickle that ``weights_only`` loading refused, naming what it needed."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
    what = f"a reference to {found.group(1)}" if found else "Python objects other than tensors"
    return UntrustedCheckpointError(
        f"{path} holds {what}, which loading would have to run as code; refused because the "
        "file is not trusted (torch.load weights_only=True).",
        hint="If you made this file or trust where it came from, pass trust=True "
        "(gpukit ckpt: --trust). Then re-save it with gk.save to get a file that needs no trust.",
    )


# pickle's message when a module lacks the class a file names: "Can't get attribute 'Net' on
# <module '__main__' ...>".
_MISSING_CLASS = re.compile(r"Can't get attribute '([\w.]+)' on <module '([\w.]+)'")


def _missing_code(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path} holds pickled objects that need {what}, which this Python cannot import.",
        hint="Load it from a program that imports the code defining it (the training script's "
        "package), then re-save the weights with gk.save to get a file that needs no code.",
    )


def _read_torch(
    path: Path, target: torch.device | None, trust: bool, folder: Path | None
) -> tuple[Any, _LocationRecorder]:
    recorder = _LocationRecorder(target)
    try:
        # An open file, not the path: torch picks safetensors from a ".safetensors" name, and
        # the bytes have already said this is a torch file.
        with os.fdopen(open_content(path, folder=folder), "rb") as handle:
            content = torch.load(handle, map_location=recorder, weights_only=not trust)
    except pickle.UnpicklingError as exc:
        if not trust and "Weights only load failed" in str(exc):
            raise untrusted_error(path, exc) from None
        raise unreadable_error(path, TORCH, exc) from None
    except ImportError as exc:
        # A trusted pickle naming a module this Python lacks: the file is whole, the code is not.
        raise _missing_code(path, exc.name or str(exc)) from None
    except AttributeError as exc:
        found = _MISSING_CLASS.search(str(exc))
        if found is None:
            raise unreadable_error(path, TORCH, exc) from None
        name, module = found.group(1), found.group(2)
        # Classes of a script run as __main__ are looked up in whatever __main__ loads the file.
        where = "the script that saved it" if module.endswith("__main__") else module
        raise _missing_code(path, f"{name} (from {where})") from None
    except CheckpointError:
        raise
    except Exception as exc:
        # Whatever else a damaged file makes torch's readers raise: RuntimeError, EOFError,
        # and from a pickle cut short or altered IndexError, struct.error, AssertionError...
        raise unreadable_error(path, TORCH, exc) from None
    return content, recorder


def _read_safetensors(
    path: Path, target: torch.device | None, folder: Path | None
) -> tuple[Any, dict[str, str]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    device = "cpu" if target is None else str(target)
    fd = open_content(path, folder=folder)
    name = fd_path(fd, path)  # the file opened and checked, not a second lookup of its name
    try:
        with safe_open(name, framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(name, device=device)
    except Exception as exc:  # safetensors raises its own (Rust) error types
        raise unreadable_error(path, SAFETENSORS, exc) from None
    finally:
        os.close(fd)
    return tensors, metadata


def unreadable_error(path: Path, fmt: str, exc: BaseException) -> CheckpointError:
    """The error for a file of format ``fmt`` that cannot be read: cut short, or damaged."""
    reason = (str(exc).split(". ")[0].splitlines() or [type(exc).__name__])[0].rstrip(".")
    try:
        with os.fdopen(untrusted.open_regular(path, follow=True), "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            head = handle.read(16)
            whole_zip = zipfile.is_zipfile(handle)
    except (OSError, untrusted.InvalidInput):  # gone or replaced since: say what was known
        size, head, whole_zip = 0, b"", True
    if fmt == TORCH and head.startswith(b"PK") and not whole_zip:
        what = "is a torch.save zip archive cut short (its central directory is missing)"
    elif fmt == SAFETENSORS and _safetensors_header(head, 1 << 62):
        (length,) = struct.unpack("<Q", head[:8])
        short = 8 + length > size
        what = (
            f"is a safetensors file cut short (its header alone needs {8 + length} bytes)"
            if short
            else f"looks like a safetensors file but cannot be read ({reason})"
        )
    else:
        looks = "a torch.save file" if fmt == TORCH else "a safetensors file"
        what = f"looks like {looks} but cannot be read ({reason})"
    return CheckpointError(
        f"{path} ({size} bytes) {what}.",
        hint="The file is probably truncated or corrupted (an interrupted copy or save); "
        "save or download it again.",
    )


def gpukit_metadata(content: Any, raw_meta: dict[str, str]) -> dict[str, Any]:
    """The metadata gk.save recorded, from a torch object or a safetensors header.

    Written by whoever made the file: the fields gpukit uses are kept only with the types
    gk.save writes (strings printable, lists of strings, ``tied`` a mapping of names), so that
    no reader of the result meets an integer where it expects a list.
    """
    if type(raw_meta.get("gpukit")) is str:
        with contextlib.suppress(untrusted.InvalidInput):
            loaded = untrusted.parse_json(raw_meta["gpukit"], limit=1 << 24)
            if type(loaded) is dict:
                return _checked_info(loaded)
    found = getattr(content, "_gpukit_metadata", None)
    return _checked_info(found) if type(found) is dict else {}


_TEXT_FIELDS = ("gpukit_version", "torch_version", "format")
_LIST_FIELDS = ("wrappers_removed", "prefixes_removed", "devices")


def _checked_info(found: dict[Any, Any]) -> dict[str, Any]:
    info = {k: v for k, v in found.items() if type(k) is str}
    for name in _TEXT_FIELDS:
        if name in info and (text := untrusted.printable(info[name], limit=200)) is not None:
            info[name] = text
        else:
            info.pop(name, None)
    for name in _LIST_FIELDS:
        values = info.pop(name, None)
        if type(values) is list and all(type(v) is str for v in values):
            info[name] = [untrusted.printable(v, limit=200) or "?" for v in values[:256]]
    tied = info.pop("tied", None)
    if type(tied) is dict and all(type(k) is str and type(v) is str for k, v in tied.items()):
        info["tied"] = tied
    if type(info.get("metadata")) is dict:
        info["metadata"] = _printable_tree(info["metadata"], 0)
    else:
        info.pop("metadata", None)
    return info


def _printable_tree(value: Any, depth: int) -> Any:
    """The user metadata gk.save recorded, every string printable (it reaches terminals),
    nested at most :data:`~gpukit.untrusted.DEPTH` deep, plain JSON types only."""
    if type(value) is str:
        return untrusted.printable(value, limit=1000) or ""
    if depth >= untrusted.DEPTH:
        return None
    if type(value) is dict:
        return {
            untrusted.printable(k, limit=200) or "?": _printable_tree(v, depth + 1)
            for k, v in value.items()
            if type(k) is str
        }
    if type(value) is list:
        return [_printable_tree(v, depth + 1) for v in value]
    return value if type(value) in (int, float, bool) or value is None else None


def read(
    path: Path, *, target: torch.device | None, trust: bool, folder: Path | None = None
) -> SingleFile:
    """Read a checkpoint file of either format, mapping tensors to ``target`` (None: CPU).

    ``folder``: the checkpoint folder the file was found in (its links must stay inside it);
    None for a file the user named.
    """
    info = check_input(path)
    if stat.S_ISDIR(info.st_mode):
        raise CheckpointError(
            f"{path} is a folder, not a checkpoint file.",
            hint="Pass the file inside it (*.pt, *.pth or *.safetensors).",
        )
    fmt = file_format(path, folder=folder)
    size = info.st_size
    if fmt == SAFETENSORS:
        content, raw_meta = _read_safetensors(path, target, folder)
        meta = gpukit_metadata(content, raw_meta)
        devices = list(meta.get("devices", [])) or ["cpu"]
        return SingleFile(path, fmt, content, devices, meta, size)
    if fmt == TORCH:
        content, recorder = _read_torch(path, target, trust, folder)
        meta = gpukit_metadata(content, {})
        return SingleFile(path, fmt, content, recorder.seen, meta, size, recorder.by_pointer)
    raise CheckpointError(
        f"{path} ({size} bytes) is not a checkpoint: its content looks like {fmt}.",
        hint="gk.load reads files written by torch.save or safetensors (*.pt, *.pth, "
        "*.safetensors).",
    )
