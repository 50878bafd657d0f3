"""``gpukit ckpt show|convert``: inspect a checkpoint, or rewrite it clean, on the CPU, in a layout.

Both take a checkpoint file (recognised by content, whatever its suffix), a sharded folder (or its
index file), a DCP folder (torchtitan's too) or an ``Accelerator.save_state`` folder. ``show``
prints what :func:`gpukit.checkpoint.describe` finds: the format, size, shards, what gk.save
recorded, the wrapper prefixes the keys carry, and a tree of the tensors with shapes, dtypes,
saved devices and parameter counts. ``convert`` runs :func:`gpukit.checkpoint.convert` and says
what it wrote and what it left out. This module parses and renders; the library decides.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpukit.cli._args import ShardSize
from gpukit.cli._output import console, human_bytes, print_json
from gpukit.sizes import DEFAULT_SHARD_SIZE

if TYPE_CHECKING:
    from rich.tree import Tree

    from gpukit.checkpoint import Description
    from gpukit.checkpoint.api import SaveTarget

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
    from gpukit.checkpoint import describe
    from gpukit.checkpoint.description import WRAPPER_OF

    found = describe(args.file, trust=args.trust)
    payload = found.to_json()
    if args.json:
        print_json(payload)
        return 0
    _print_description(found, payload, WRAPPER_OF)
    return 0


def _print_description(
    found: Description, payload: dict[str, Any], wrapper_of: dict[str, str]
) -> None:
    out = console()
    meta = found.metadata
    out.print(
        f"{payload['path']}: {found.format}, {human_bytes(found.size)}, "
        f"{len(found.tensors)} tensors, {found.parameter_count:,} params"
    )
    if found.suffix_mismatch:
        out.print(f"note: {found.suffix_mismatch} (gpukit reads it by its content)")
    if found.files:
        data = {name: size for name, size in found.files.items() if name != found.index}
        files = ", ".join(f"{name} {human_bytes(size)}" for name, size in data.items())
        kind = {"dcp": "data file", "accelerate": "file"}.get(found.layout, "shard")
        plural = "s" if len(data) != 1 else ""
        index = f"; index {found.index}" if found.index else ""
        out.print(f"{len(data)} {kind}{plural} ({files}){index}")
    saved = ", ".join(found.source_devices) or "n/a"
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
    if found.prefixes:
        carried = ", ".join(f"{p} ({wrapper_of.get(p, 'a wrapper')})" for p in found.prefixes)
        out.print(f"keys carry {carried}: gk.load removes them; gpukit ckpt convert rewrites them")
    others = ", ".join(f"{k}: {v}" for k, v in found.other_entries.items())
    if not found.weights_found:
        what = f"its entries are {others}" if others else f"it holds a {found.holds}"
        out.print(f"no model weights found (gk.load would refuse it): {what}")
    elif found.container_key is not None or found.weights_at_top_level:
        where = (
            "the top-level tensors (no nested state dict)"
            if found.weights_at_top_level
            else f"under {found.container_key!r}"
        )
        out.print(f"weights {where}; other entries: {others or 'none'}")
    out.print(_tree(payload))


def _check_paths(args: argparse.Namespace) -> SaveTarget:
    """Refuse path mistakes before reading anything: where the output goes, in which layout."""
    from gpukit.checkpoint.api import check_save_target
    from gpukit.checkpoint.paths import check_input

    check_input(args.input)
    return check_save_target(args.output, args.max_shard_size, option="--max-shard-size")


def _convert(args: argparse.Namespace) -> int:
    planned = _check_paths(args)
    from gpukit.checkpoint import convert

    done = convert(args.input, planned, weights_only=args.weights_only, trust=args.trust)
    removed = f"; removed {', '.join(done.prefixes_removed)}" if done.prefixes_removed else ""
    layout = "sharded safetensors folder" if done.sharded else done.format
    out = console()
    out.print(f"wrote {args.output} ({layout}{removed}; tensors on cpu)")
    if done.left_out:
        # Each hint names a way that does keep everything, from where the user stands.
        if done.weights_only_asked:
            why, keep_all = " (--weights-only)", "drop --weights-only"
        else:
            why, keep_all = " (safetensors holds only tensors)", "convert to a .pt file"
        out.print(
            f"left out {', '.join(done.left_out)}: kept only {done.kept}{why}; {keep_all} to "
            "keep everything"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``gpukit ckpt show`` or ``gpukit ckpt convert``."""
    if args.action == "show":
        return _show(args)
    return _convert(args)
