"""``gpukit ckpt show|convert``: inspect a checkpoint, or rewrite it clean, on the CPU, in a layout.

Both take a checkpoint file (recognised by content, whatever its suffix), a sharded folder (or its
index file) or a DCP folder. ``show`` prints the format, size, shards, what gk.save recorded, the
wrapper prefixes the keys carry, and a tree of the tensors with shapes, dtypes, saved devices and
parameter counts; a folder's tensors are described from its headers without being read.
``convert`` removes wrapper prefixes, moves every tensor to the CPU and writes, atomically, what
the output path asks for: ``.pt`` / ``.pth``, ``.safetensors``, or a sharded safetensors folder
for a path without a suffix (or with ``--max-shard-size``). Safetensors holds only tensors: from
a training checkpoint it gets the model's weights, and the command says what was left out.
Paths are checked before any work starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpukit.cli._output import console, human_bytes, print_json
from gpukit.errors import CheckpointError

if TYPE_CHECKING:
    from rich.tree import Tree

    from gpukit.checkpoint.io import RawCheckpoint
    from gpukit.checkpoint.layout import FolderCheckpoint

SCHEMA = "gpukit.ckpt.show/1"
_WRAPPER_OF = {
    "module.": "nn.DataParallel or DistributedDataParallel",
    "_orig_mod.": "torch.compile",
    "_fsdp_wrapped_module.": "FullyShardedDataParallel",
    "_checkpoint_wrapped_module.": "activation checkpointing",
    "_forward_module.": "Lightning Fabric",
}
_TRUST_HELP = "allow a pickle that runs code (only for files you made or trust)"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``show`` and ``convert`` subcommands."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="format, metadata, wrappers and a tree of the tensors")
    show.add_argument(
        "file", type=Path, help="a checkpoint file, a sharded folder or its index, a DCP folder"
    )
    show.add_argument("--json", action="store_true", help="print JSON (with a schema field)")
    show.add_argument("--trust", action="store_true", help=_TRUST_HELP)
    convert = sub.add_parser(
        "convert", help="clean the keys, move tensors to the CPU, change layout by the output path"
    )
    convert.add_argument("input", type=Path, help="the checkpoint to read (file or folder)")
    convert.add_argument(
        "output",
        type=Path,
        help="*.pt / *.pth (anything), *.safetensors (weights), or a folder name without a "
        "suffix (sharded safetensors)",
    )
    convert.add_argument(
        "--weights-only",
        action="store_true",
        help="keep only the model's weights (drop optimizer state, epoch, ...); implied for "
        "safetensors and folders",
    )
    convert.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="write a sharded folder with shards of at most SIZE (e.g. 2GB, 500MiB; default 5GB)",
    )
    convert.add_argument("--trust", action="store_true", help=_TRUST_HELP)


def _read(path: Path, trust: bool) -> RawCheckpoint | FolderCheckpoint:
    import torch

    from gpukit.checkpoint.layout import open_checkpoint

    return open_checkpoint(path, target=torch.device("cpu"), trust=trust)


def _tensor_rows(
    raw: RawCheckpoint | FolderCheckpoint, state: Mapping[str, Any]
) -> list[dict[str, Any]]:
    import torch

    rows = []
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        rows.append(
            {
                "key": key,
                "shape": list(value.shape),
                "dtype": str(value.dtype).removeprefix("torch."),
                "device": raw.saved_device(value),
                "numel": value.numel(),
            }
        )
    return rows


def _describe(value: object) -> str:
    import torch

    from gpukit.checkpoint.layout import StoredObject

    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)}"
    if isinstance(value, (int, float, str, bool)) or value is None:
        return repr(value)[:60]
    if isinstance(value, Mapping):
        return f"dict of {len(value)}"
    if isinstance(value, StoredObject):
        return repr(value)
    return type(value).__name__


def _suffix_note(raw: RawCheckpoint | FolderCheckpoint) -> str | None:
    from gpukit.checkpoint.io import SAFETENSORS, TORCH
    from gpukit.checkpoint.layout import FolderCheckpoint

    if isinstance(raw, FolderCheckpoint):
        return None
    suffix = raw.path.suffix.lower()
    named = (
        SAFETENSORS if suffix == ".safetensors" else TORCH if suffix in _TORCH_SUFFIXES else None
    )
    if named is None or named == raw.format:
        return None
    what = "a torch.save file" if raw.format == TORCH else "a safetensors file"
    return f"named {suffix} but holds {what}"


_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def _payload(raw: RawCheckpoint | FolderCheckpoint) -> dict[str, Any]:
    from gpukit.checkpoint.keys import clean_keys, find_state_dict
    from gpukit.checkpoint.layout import FolderCheckpoint

    found = True
    try:
        state, container = find_state_dict(raw.content)
    except LookupError:
        state, container, found = {}, None, False
    _, prefixes = clean_keys(state)
    others: dict[str, str] = {}
    # Without weights, every top-level entry is "other": show what the file does hold.
    if (container is not None or not found) and isinstance(raw.content, Mapping):
        others = {str(k): _describe(v) for k, v in raw.content.items() if k != container}
    rows = _tensor_rows(raw, state)
    return {
        "schema": SCHEMA,
        "path": str(raw.path),
        "format": raw.format,
        "size_bytes": raw.size,
        "metadata": raw.metadata,
        "container_key": container,
        "other_entries": others,
        "prefixes": prefixes,
        "wrappers": [_WRAPPER_OF[p] for p in prefixes if p in _WRAPPER_OF],
        "wrappers_removed_at_save": raw.metadata.get("wrappers_removed", []),
        "source_devices": raw.source_devices,
        "layout": ("dcp" if raw.format == "dcp" else "sharded")
        if isinstance(raw, FolderCheckpoint)
        else "file",
        "files": [
            {"name": name, "size_bytes": size}
            for name, size in (raw.files.items() if isinstance(raw, FolderCheckpoint) else ())
        ],
        "shard_count": len(raw.files) - 1 if isinstance(raw, FolderCheckpoint) else None,
        "index_file": raw.index if isinstance(raw, FolderCheckpoint) else None,
        "suffix_mismatch": _suffix_note(raw),
        "weights_found": found,
        "tensor_count": len(rows),
        "parameter_count": sum(row["numel"] for row in rows),
        "tensors": rows,
    }


def _tree(payload: dict[str, Any]) -> Tree:
    from rich.text import Text
    from rich.tree import Tree

    # Text objects, not markup strings: a key may well contain "[...]".
    name = Path(payload["path"]).name
    root = Tree(Text.assemble((name, "bold"), f" ({payload['parameter_count']:,} params)"))
    nodes: dict[str, Tree] = {"": root}
    totals: dict[str, int] = {}
    for row in payload["tensors"]:
        parts = row["key"].split(".")
        for depth in range(1, len(parts)):
            totals[".".join(parts[:depth])] = totals.get(".".join(parts[:depth]), 0) + row["numel"]
    for row in payload["tensors"]:
        parts = row["key"].split(".")
        parent = ""
        for depth in range(1, len(parts)):
            name = ".".join(parts[:depth])
            if name not in nodes:
                label = Text(f"{parts[depth - 1]} ({totals[name]:,} params)")
                nodes[name] = nodes[parent].add(label)
            parent = name
        device = row["device"] or "n/a"
        nodes[parent].add(
            Text.assemble(
                f"{parts[-1]}  {row['shape']}  {row['dtype']}  {device}  ",
                (f"{row['numel']:,}", "dim"),
            )
        )
    return root


def _show(args: argparse.Namespace) -> int:
    from gpukit.checkpoint.paths import check_input

    check_input(args.file)  # a FIFO or an unreadable file, refused before torch is imported
    raw = _read(args.file, args.trust)
    payload = _payload(raw)
    if args.json:
        print_json(payload)
        return 0
    out = console()
    meta = payload["metadata"]
    out.print(
        f"{payload['path']}: {payload['format']}, {human_bytes(payload['size_bytes'])}, "
        f"{payload['tensor_count']} tensors, {payload['parameter_count']:,} params"
    )
    if payload["suffix_mismatch"]:
        out.print(f"note: {payload['suffix_mismatch']} (gpukit reads it by its content)")
    if payload["files"]:
        data = [f for f in payload["files"] if f["name"] != payload["index_file"]]
        files = ", ".join(f"{f['name']} {human_bytes(f['size_bytes'])}" for f in data)
        kind = "data file" if payload["layout"] == "dcp" else "shard"
        plural = "s" if len(data) != 1 else ""
        out.print(f"{len(data)} {kind}{plural} ({files}); index {payload['index_file']}")
    saved = ", ".join(payload["source_devices"]) or "n/a"
    if meta:
        removed = ", ".join(meta.get("wrappers_removed", [])) or "none"
        out.print(
            f"saved by gpukit {meta.get('gpukit_version', '?')} with torch "
            f"{meta.get('torch_version', '?')} from {saved}; wrappers removed: {removed}"
        )
        if meta.get("metadata"):
            out.print(f"metadata: {meta['metadata']}")
    else:
        out.print(f"saved from {saved} (not written by gk.save)")
    if payload["prefixes"]:
        carried = ", ".join(f"{p} ({_WRAPPER_OF.get(p, 'a wrapper')})" for p in payload["prefixes"])
        out.print(f"keys carry {carried}: gk.load removes them; gpukit ckpt convert rewrites them")
    if not payload["weights_found"]:
        held = ", ".join(f"{k}: {v}" for k, v in payload["other_entries"].items())
        what = f"its entries are {held}" if held else f"it holds a {type(raw.content).__name__}"
        out.print(f"no model weights found (gk.load would refuse it): {what}")
    elif payload["container_key"] is not None:
        others = ", ".join(f"{k}: {v}" for k, v in payload["other_entries"].items()) or "none"
        out.print(f"weights under {payload['container_key']!r}; other entries: {others}")
    out.print(_tree(payload))
    return 0


def _check_paths(args: argparse.Namespace) -> int | None:
    """Refuse path mistakes before reading anything; the shard size limit for a folder output."""
    from gpukit.checkpoint.paths import check_input, check_output_file, check_output_folder

    check_input(args.input)
    folder = args.max_shard_size is not None or args.output.suffix == ""
    if folder:
        check_output_folder(args.output, _is_layout_file)
    else:
        check_output_file(args.output)
    from gpukit.checkpoint.io import suffix_format
    from gpukit.checkpoint.sharded import parse_size

    if folder:
        return parse_size("5GB" if args.max_shard_size is None else args.max_shard_size)
    suffix_format(args.output)
    return None


def _is_layout_file(name: str) -> bool:
    from gpukit.checkpoint.api import is_layout_file

    return is_layout_file(name)


def _convert(args: argparse.Namespace) -> int:
    from gpukit.checkpoint.api import save
    from gpukit.checkpoint.io import SAFETENSORS, suffix_format
    from gpukit.checkpoint.keys import find_state_dict
    from gpukit.checkpoint.layout import FolderCheckpoint

    limit = _check_paths(args)
    raw = _read(args.input, args.trust)
    content = raw.read_all(trust=args.trust) if isinstance(raw, FolderCheckpoint) else raw.content
    weights_only = (
        args.weights_only or limit is not None or suffix_format(args.output) == SAFETENSORS
    )
    obj: object = content
    left_out: list[str] = []
    if weights_only:
        try:
            state, container = find_state_dict(content)
        except LookupError as exc:
            raise CheckpointError(
                f"{args.input} holds no model weights to convert: {exc}.",
                hint="Convert it to .pt, which keeps anything torch.save wrote.",
            ) from None
        if container is not None and isinstance(content, Mapping):
            left_out = [str(k) for k in content if k != container]
        obj = state
    source = {"converted_from": args.input.name, "source_devices": raw.source_devices}
    prefixes = _prefixes(obj)
    save(obj, args.output, metadata=source, max_shard_size=limit)
    layout = "sharded safetensors folder" if limit is not None else suffix_format(args.output)
    removed = f"; removed {', '.join(prefixes)}" if prefixes else ""
    out = console()
    out.print(f"wrote {args.output} ({layout}{removed}; tensors on cpu)")
    if left_out:
        shown = ", ".join(left_out)
        why = "" if args.weights_only else " (safetensors holds only tensors)"
        out.print(
            f"left out {shown}: kept only the weights under {container!r}{why}; convert to "
            ".pt to keep everything"
        )
    return 0


def _prefixes(obj: object) -> list[str]:
    from gpukit.checkpoint.keys import clean_keys, find_state_dict

    try:
        state, _ = find_state_dict(obj)
    except LookupError:
        return []
    return clean_keys(state)[1]


def run(args: argparse.Namespace) -> int:
    """Run ``gpukit ckpt show`` or ``gpukit ckpt convert``."""
    if args.action == "show":
        return _show(args)
    return _convert(args)
