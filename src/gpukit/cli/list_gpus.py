"""``gpukit list``: one line per GPU with its memory, load and users, like a better nvidia-smi.

Never imports torch, and imports rich only for human output, so that it starts fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gpukit.cli._output import human_bytes, na, print_json
from gpukit.inventory import GPU, GpuProcess, Inventory, inventory
from gpukit.visible import VisibleDevices, visible_devices

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table

    from gpukit.claims import Holder

_BAR_WIDTH = 10
# Free-text columns, cut to fit a narrow terminal.
_CUT = frozenset({"name", "claimed by", "user:pid command (memory)"})


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit list``."""
    parser.add_argument("--json", action="store_true", help="print JSON (with a schema field)")
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C; with --json, one document a line",
    )


def _claims() -> dict[str, Holder]:
    """Claims held right now by gpukit users on this machine, by GPU UUID."""
    from gpukit.claims import current_claims

    return current_claims()


def _payload(inv: Inventory, view: VisibleDevices) -> dict[str, Any]:
    claims = {uuid: holder.to_json() for uuid, holder in _claims().items()}
    return {**inv.to_json(), "visible": view.to_json(), "claims": claims}


def _bar(used: int | None, total: int | None) -> str:
    if used is None or not total:
        return " " * _BAR_WIDTH
    filled = round(_BAR_WIDTH * min(used / total, 1.0))
    return "█" * filled + "░" * (_BAR_WIDTH - filled)


def _memory(used: int | None, total: int | None) -> str:
    if used is None or total is None:
        return f"{_bar(used, total)} n/a"
    return f"{_bar(used, total)} {used / 2**30:5.1f}/{total / 2**30:.0f} GiB"


def _short_name(name: str, parent: str = "") -> str:
    # "NVIDIA A100-SXM4-80GB" -> "A100-SXM4-80GB"; a MIG instance drops its GPU's name.
    if parent and name.startswith(parent):
        name = "MIG" + name[len(parent) :].replace(" MIG", "", 1)
    return name.removeprefix("NVIDIA ")


def _process_line(p: GpuProcess) -> str:
    command = (p.command or "?")[:40]
    return f"{p.user or '?'}:{p.pid} {command} ({human_bytes(p.used_memory)})"


def _power(gpu: GPU) -> str:
    if gpu.power_draw_w is None:
        return "n/a"
    limit = "" if gpu.power_limit_w is None else f"/{gpu.power_limit_w:.0f}"
    return f"{gpu.power_draw_w:.0f}{limit} W"


def _rows(
    inv: Inventory, view: VisibleDevices, claims: Mapping[str, str] | None
) -> list[tuple[list[str], str]]:
    """(cells, style) per line: each GPU, then its MIG instances."""
    show_cuda = _show_cuda(view)
    cuda = view.cuda_indices()
    rows: list[tuple[list[str], str]] = []

    def add(
        index: str,
        cuda_ids: list[int],
        name: str,
        memory: str,
        readings: list[str],
        uuid: str,
        procs: tuple[GpuProcess, ...],
        style: str = "",
    ) -> None:
        cells = [index]
        if show_cuda:
            cells.append(",".join(f"cuda:{i}" for i in cuda_ids) or "-")
        cells += [name, memory, *readings]
        if claims is not None:
            cells.append(claims.get(uuid, "-"))
        cells.append(", ".join(_process_line(p) for p in procs) or "-")
        rows.append((cells, style))

    for gpu in inv.gpus:
        readings = [na(gpu.utilization_gpu, "{}%"), na(gpu.temperature_c, "{}°C"), _power(gpu)]
        # On a MIG GPU the processes are shown under the instance they run in.
        add(
            str(gpu.index),
            cuda.get(gpu.index, []),
            _short_name(gpu.name) if gpu.error is None else f"unreadable: {gpu.error}",
            _memory(gpu.memory_used, gpu.memory_total),
            readings,
            gpu.uuid,
            () if gpu.mig_instances else gpu.processes,
            style="" if gpu.error is None else "red",
        )
        for mig in gpu.mig_instances:
            mig_cuda = [d.cuda_index for d in view.devices or () if d.mig_uuid == mig.uuid]
            add(
                f"{gpu.index}.{mig.index}",
                mig_cuda,
                f"└ {_short_name(mig.name or 'MIG', gpu.name)}",
                _memory(mig.memory_used, mig.memory_total),
                ["", "", ""],
                mig.uuid,
                mig.processes,
                style="dim",
            )
    return rows


def _show_cuda(view: VisibleDevices) -> bool:
    # CUDA's numbers are worth a column when they can differ from nvidia-smi's.
    return view.restricted or any(d.cuda_index != d.nvml_index for d in view.devices or ())


def build_table(
    inv: Inventory,
    view: VisibleDevices,
    *,
    claims: Mapping[str, str] | None = None,
) -> Table:
    """The table of GPUs; ``claims`` (GPU UUID -> holder) adds a "claimed by" column."""
    from rich.table import Table
    from rich.text import Text

    headers = [
        "GPU",
        *(["CUDA"] if _show_cuda(view) else []),
        "name",
        "memory",
        "util",
        "temp",
        "power",
        *(["claimed by"] if claims is not None else []),
        "user:pid command (memory)",
    ]
    right = {"GPU", "CUDA", "util", "temp", "power"}
    rows = _rows(inv, view, claims)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for i, header in enumerate(headers):
        # The readings keep their full width; on a narrow terminal only the free-text columns
        # are cut (with an ellipsis), so each GPU stays on one line and keeps its index. rich
        # shrinks only wrappable columns first; when every column is no_wrap it shrinks them
        # all evenly and the narrow index column vanishes.
        cut = header in _CUT
        width = max([len(header), *(len(cells[i]) for cells, _ in rows)])
        table.add_column(
            Text(header, no_wrap=True, overflow="ellipsis"),
            justify="right" if header in right else "left",
            no_wrap=not cut,
            min_width=None if cut else width,
            overflow="ellipsis" if cut else "fold",
        )
    for cells, style in rows:
        # Text, not markup: a command line such as `train.py tags=[/x]` is shown as it is
        # (as a markup string it would vanish or raise, and any user can start such a process).
        table.add_row(
            *(Text(cell, no_wrap=True, overflow="ellipsis") for cell in cells), style=style
        )
    return table


def _render(inv: Inventory, view: VisibleDevices) -> RenderableType:
    from rich.console import Group
    from rich.text import Text

    head = Text(
        f"driver {na(inv.driver_version)} · CUDA {na(inv.cuda_driver_version)} · "
        f"{len(inv.gpus)} GPU{'s' * (len(inv.gpus) != 1)} · "
        f"{time.strftime('%H:%M:%S', time.localtime(inv.taken_at))}",
        style="dim",
    )
    if view.restricted:
        head.append(f" · CUDA_VISIBLE_DEVICES={view.env}")
    held = _claims()
    claims = {uuid: holder.describe() for uuid, holder in held.items()} if held else None
    parts: list[RenderableType] = [head, build_table(inv, view, claims=claims)]
    parts.extend(Text(f"note: {w}", style="yellow") for w in view.warnings)
    return Group(*parts)


def _print(out: Console, renderable: RenderableType) -> None:
    if not out.is_terminal:
        # A log or a pipe has no edge: give every line its full width instead of cutting it.
        wide = out.options.update_width(10_000)
        out.width = max(out.width, out.measure(renderable, options=wide).maximum)
    out.print(renderable)


def _read() -> tuple[Inventory, VisibleDevices]:
    inv = inventory()
    return inv, visible_devices(inv)


def _watch(args: argparse.Namespace) -> int:
    from rich.live import Live

    from gpukit.cli._output import console

    out = console()
    interval = max(float(args.watch), 0.05)
    try:
        if args.json or not out.is_terminal:
            # A log or a program: a full reading per interval, never cursor movement.
            while True:
                inv, view = _read()
                if args.json:
                    sys.stdout.write(json.dumps(_payload(inv, view), default=str) + "\n")
                    sys.stdout.flush()
                else:
                    _print(out, _render(inv, view))
                time.sleep(interval)
        # auto_refresh off: the screen changes only when a new reading arrives, so an idle
        # watch costs one NVML reading per interval and no redraws in between.
        with Live(_render(*_read()), console=out, auto_refresh=False, transient=False) as live:
            while True:
                time.sleep(interval)
                live.update(_render(*_read()), refresh=True)
    except KeyboardInterrupt:
        return 0


def run(args: argparse.Namespace) -> int:
    """Print the GPUs once, or keep a live view with ``--watch``."""
    fake = os.environ.get("GPUKIT_FAKE_NVML")
    if fake:
        print(
            f"gpukit list: reading a fake machine from {fake} (GPUKIT_FAKE_NVML).", file=sys.stderr
        )
    if args.watch is not None:
        return _watch(args)
    inv, view = _read()
    if args.json:
        print_json(_payload(inv, view))
        return 0
    from gpukit.cli._output import console

    _print(console(), _render(inv, view))
    return 0
