"""The table of GPUs that ``gpukit list`` and ``gpukit info`` show: one line per GPU."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gpukit.cli._output import human_bytes, na

if TYPE_CHECKING:
    from rich.table import Table

    from gpukit.gpus.hosts import HostReading
    from gpukit.gpus.inventory import GPU, GpuProcess, Inventory
    from gpukit.gpus.visible import VisibleDevices

_BAR_WIDTH = 10
# Free-text columns, cut to fit a narrow terminal.
_CUT = frozenset({"name", "claimed by", "user:pid command (memory)"})


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


def build_hosts_table(readings: Sequence[HostReading]) -> Table:
    """One table of several machines' GPUs, a section per host; a failed host shows why."""
    from rich.table import Table
    from rich.text import Text

    from gpukit.gpus.visible import resolve

    headers = ["host", "GPU", "name", "memory", "util", "temp", "power", "claimed by"]
    headers.append("user:pid command (memory)")
    table = Table(box=None, pad_edge=False, header_style="bold")
    for header in headers:
        cut = header in _CUT or header == "host"
        table.add_column(
            Text(header, no_wrap=True, overflow="ellipsis"),
            justify="right" if header in {"GPU", "util", "temp", "power"} else "left",
            no_wrap=not cut,
            overflow="ellipsis" if cut else "fold",
        )
    for i, reading in enumerate(readings):
        if i:
            table.add_section()
        if reading.inventory is None:
            # The reason goes last, where a long line may run on without widening the GPU columns.
            blank = ["" for _ in headers[3:-1]]
            cells = [reading.host, "-", "no GPUs read", *blank, reading.error or "no answer"]
            table.add_row(*(Text(c, no_wrap=True) for c in cells), style="red")
            continue
        # CUDA's numbering there is unknown from here: show nvidia-smi's, as the host would.
        view = resolve(None, "PCI_BUS_ID", reading.inventory)
        claims = {uuid: holder.describe() for uuid, holder in reading.claims.items()}
        for j, (cells, style) in enumerate(_rows(reading.inventory, view, claims)):
            host = reading.host if j == 0 else ""
            table.add_row(
                *(Text(c, no_wrap=True, overflow="ellipsis") for c in [host, *cells]), style=style
            )
    return table
