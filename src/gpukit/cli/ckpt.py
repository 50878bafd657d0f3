"""``gpukit ckpt show|convert``: inspect a checkpoint, or rewrite it clean, on the CPU, in a layout.

Both take a checkpoint file (recognised by content, whatever its suffix), a sharded folder (or its
index file), a DCP folder (torchtitan's too) or an ``Accelerator.save_state`` folder. ``show``
prints the format, size, shards, what gk.save recorded, the wrapper prefixes the keys carry, and
a tree of the tensors with shapes, dtypes, saved devices and parameter counts; a folder's
tensors are described from its headers without being read.
``convert`` removes wrapper prefixes, moves every tensor to the CPU and writes, atomically, what
the output path asks for: ``.pt`` / ``.pth``, ``.safetensors``, or a sharded safetensors folder
for a path without a suffix (or with ``--max-shard-size``, refused with a file's suffix).
Safetensors holds only tensors: from a training checkpoint it gets the model's weights, and the
command says what was left out; only what the output keeps is read. Paths are checked before any
work starts; missing parent folders of the output are created.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpukit.cli._args import ShardSize
from gpukit.cli._output import console, human_bytes, print_json
from gpukit.errors import CheckpointError
from gpukit.sizes import DEFAULT_SHARD_SIZE

if TYPE_CHECKING:
    from rich.tree import Tree

    from gpukit.checkpoint.api import SaveTarget
    from gpukit.checkpoint.single_file import RawCheckpoint
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
        type=ShardSize(),
        help="write a sharded folder with shards of at most SIZE (e.g. 2GB, 1.5G, 500MiB; "
        f"GB is 10**9 bytes, G and GiB 2**30; default {DEFAULT_SHARD_SIZE})",
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
    from gpukit.checkpoint.single_file import SAFETENSORS, TORCH
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


def _layout(raw: RawCheckpoint | FolderCheckpoint) -> str:
    from gpukit.checkpoint.layout import ACCELERATE, FolderCheckpoint

    if not isinstance(raw, FolderCheckpoint):
        return "file"
    return {"dcp": "dcp", ACCELERATE: "accelerate"}.get(raw.format, "sharded")


def _payload(raw: RawCheckpoint | FolderCheckpoint) -> dict[str, Any]:
    from gpukit.checkpoint.keys import clean_keys, find_weights
    from gpukit.checkpoint.layout import FolderCheckpoint

    found, top_level, named = True, False, []
    try:
        weights = find_weights(raw.content)
        state, container = weights.state, weights.container
        top_level, named = weights.top_level, weights.others
    except LookupError:
        state, container, found = {}, None, False
    _, prefixes = clean_keys(state)
    others: dict[str, str] = {}
    if isinstance(raw.content, Mapping):
        # Without weights, every top-level entry is "other": show what the file does hold.
        shown = set(named) if found else {str(k) for k in raw.content}
        others = {str(k): _describe(v) for k, v in raw.content.items() if str(k) in shown}
    rows = _tensor_rows(raw, state)
    layout = _layout(raw)
    indexed = layout in ("dcp", "sharded")
    return {
        "schema": SCHEMA,
        "path": str(raw.path),
        "format": raw.format,
        "size_bytes": raw.size,
        "metadata": raw.metadata,
        "container_key": container,
        "weights_at_top_level": top_level,
        "other_entries": others,
        "prefixes": prefixes,
        "wrappers": [_WRAPPER_OF[p] for p in prefixes if p in _WRAPPER_OF],
        "wrappers_removed_at_save": raw.metadata.get("wrappers_removed", []),
        "source_devices": raw.source_devices,
        "layout": layout,
        "files": [
            {"name": name, "size_bytes": size}
            for name, size in (raw.files.items() if isinstance(raw, FolderCheckpoint) else ())
        ],
        "shard_count": len(raw.files) - 1
        if indexed and isinstance(raw, FolderCheckpoint)
        else None,
        "index_file": raw.index if indexed and isinstance(raw, FolderCheckpoint) else None,
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
        kind = {"dcp": "data file", "accelerate": "file"}.get(payload["layout"], "shard")
        plural = "s" if len(data) != 1 else ""
        index = f"; index {payload['index_file']}" if payload["index_file"] else ""
        out.print(f"{len(data)} {kind}{plural} ({files}){index}")
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
    elif payload["container_key"] is not None or payload["weights_at_top_level"]:
        others = ", ".join(f"{k}: {v}" for k, v in payload["other_entries"].items()) or "none"
        where = (
            "the top-level tensors (no nested state dict)"
            if payload["weights_at_top_level"]
            else f"under {payload['container_key']!r}"
        )
        out.print(f"weights {where}; other entries: {others}")
    out.print(_tree(payload))
    return 0


def _check_paths(args: argparse.Namespace) -> SaveTarget:
    """Refuse path mistakes before reading anything: where the output goes, in which layout."""
    from gpukit.checkpoint.api import check_save_target
    from gpukit.checkpoint.paths import check_input

    check_input(args.input)
    return check_save_target(args.output, args.max_shard_size, option="--max-shard-size")


def _weights_of(
    raw: RawCheckpoint | FolderCheckpoint, args: argparse.Namespace, keep_all_hint: str
) -> tuple[object, list[str], str]:
    """The model's weights alone (nothing else read), the entries left out, where they were."""
    from gpukit.checkpoint.keys import find_weights
    from gpukit.checkpoint.layout import FolderCheckpoint

    try:
        found = find_weights(raw.content)
    except LookupError as exc:
        raise CheckpointError(
            f"{args.input} holds no model weights to convert: {exc}.",
            hint=f"{keep_all_hint.capitalize()} to keep what it holds: a .pt file keeps anything "
            "torch.save wrote.",
        ) from None
    state: object = found.state
    if isinstance(raw, FolderCheckpoint):
        state = find_weights(raw.read_weights(found, trust=args.trust)).state
    where = (
        "the top-level tensors"
        if found.top_level
        else f"the weights under {found.container!r}"
        if found.container is not None
        else "the weights"
    )
    return state, found.others, where


def _convert(args: argparse.Namespace) -> int:
    from gpukit.checkpoint.api import save
    from gpukit.checkpoint.single_file import TORCH
    from gpukit.checkpoint.layout import FolderCheckpoint

    planned = _check_paths(args)
    raw = _read(args.input, args.trust)
    to_torch = planned.format == TORCH
    # Each hint names a way that does keep everything, from where the user stands.
    keep_all = "drop --weights-only" if to_torch else "convert to a .pt file"
    obj: object
    left_out: list[str] = []
    where = ""
    if args.weights_only or not to_torch:
        # Only what the output keeps is read: a pickle beside the weights is never unpickled.
        obj, left_out, where = _weights_of(raw, args, keep_all)
    else:
        obj = raw.read_all(trust=args.trust) if isinstance(raw, FolderCheckpoint) else raw.content
    source = {"converted_from": args.input.name, "source_devices": raw.source_devices}
    prefixes = _prefixes(obj)
    save(obj, args.output, metadata=source, max_shard_size=planned.shard_limit)
    removed = f"; removed {', '.join(prefixes)}" if prefixes else ""
    out = console()
    layout = "sharded safetensors folder" if planned.shard_limit is not None else planned.format
    out.print(f"wrote {args.output} ({layout}{removed}; tensors on cpu)")
    if left_out:
        why = " (--weights-only)" if to_torch else " (safetensors holds only tensors)"
        out.print(
            f"left out {', '.join(left_out)}: kept only {where}{why}; {keep_all} to keep everything"
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
