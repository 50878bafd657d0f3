"""The table of GPUs that ``gpukit list`` and ``gpukit info`` show: one line per GPU.

Two layouts. The full one has a memory bar, the power draw and each process's memory; when it
does not fit the terminal, the compact one drops the bar, the power column and the per-process
memory, so that on 80 columns (nvidia-smi's and gpustat's width) who claimed and who uses each
GPU stay readable: those are the columns the table exists for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpukit.cli._output import human_bytes, na

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions
    from rich.measure import Measurement
    from rich.text import Text

    from gpukit.gpus.hosts import HostReading
    from gpukit.gpus.inventory import GPU, GpuProcess, Inventory
    from gpukit.gpus.visible import VisibleDevices
    from gpukit.holders import Holder

_BAR_WIDTH = 10
_GAP = 2  # rich's padding between two columns
# Free-text columns, cut to fit a narrow terminal.
_CUT = frozenset({"host", "name", "claimed by", "user:pid command (memory)", "user:pid command"})
_RIGHT = frozenset({"GPU", "CUDA", "memory", "util", "temp", "power"})
# In the compact layout these give way first, down to this many characters; who holds and who
# uses each GPU share the rest.
_GIVE_WAY = {"name": 9, "host": 8}


@dataclass(frozen=True)
class _Row:
    cells: list[str]
    style: str = ""
    message: str | None = None
    """A host's error: shown after the first ``cells``, from the name column to the end of the
    line, whole; it never widens the table's columns."""
    section: bool = False
    """A line between two hosts, not a row."""


_Build = Callable[[bool], tuple[list[str], list[_Row]]]


def _bar(used: int | None, total: int | None) -> str:
    if used is None or not total:
        return " " * _BAR_WIDTH
    filled = round(_BAR_WIDTH * min(max(used / total, 0.0), 1.0))
    return "█" * filled + "░" * (_BAR_WIDTH - filled)


def _used_of(used: int, total: int) -> str:
    """``'71.6/80 GiB'``, or ``'512 MiB/80 GiB'`` when the two need different units.

    Both sizes are written by :func:`gpukit.sizes.format_size`, as everywhere else in gpukit;
    a unit the two share is said once, so the column stays narrow.
    """
    used_text, total_text = human_bytes(used), human_bytes(total)
    number, _, unit = used_text.partition(" ")
    if total_text.endswith(f" {unit}"):
        return f"{number}/{total_text}"
    return f"{used_text}/{total_text}"


def _memory(used: int | None, total: int | None, *, compact: bool) -> str:
    if used is None or total is None:
        return "n/a" if compact else f"{_bar(used, total)} n/a"
    if compact:
        return _used_of(used, total)
    return f"{_bar(used, total)} {_used_of(used, total)}"


def _short_name(name: str, parent: str = "") -> str:
    # "NVIDIA A100-SXM4-80GB" -> "A100-SXM4-80GB"; a MIG instance drops its GPU's name.
    if parent and name.startswith(parent):
        name = "MIG" + name[len(parent) :].replace(" MIG", "", 1)
    return name.removeprefix("NVIDIA ")


def _process_line(p: GpuProcess, *, compact: bool) -> str:
    command = (p.command or "?")[:40]
    line = f"{p.user or '?'}:{p.pid} {command}"
    return line if compact else f"{line} ({human_bytes(p.used_memory)})"


def _holder(h: Holder, *, compact: bool) -> str:
    # Compact, a holder reads as a process does: "alice:4242 python train.py".
    if not compact or h.problem:
        return h.describe()
    return f"{h.user or '?'}:{'?' if h.pid is None else h.pid} {h.command or ''}".rstrip()


def _power(gpu: GPU) -> str:
    if gpu.power_draw_w is None:
        return "n/a"
    limit = "" if gpu.power_limit_w is None else f"/{gpu.power_limit_w:.0f}"
    return f"{gpu.power_draw_w:.0f}{limit} W"


def _headers(*, cuda: bool, claims: bool, compact: bool) -> list[str]:
    return [
        "GPU",
        *(["CUDA"] if cuda else []),
        "name",
        "memory",
        "util",
        "temp",
        *([] if compact else ["power"]),
        *(["claimed by"] if claims else []),
        "user:pid command" if compact else "user:pid command (memory)",
    ]


@dataclass(frozen=True)
class _CudaNumbers:
    """CUDA's indices of each GPU and MIG instance, looked up once for the whole table."""

    gpus: Mapping[int, list[int]]
    migs: Mapping[str, list[int]]

    @classmethod
    def of(cls, view: VisibleDevices) -> _CudaNumbers:
        migs: dict[str, list[int]] = {}
        for d in view.devices or ():
            if d.mig_uuid is not None:
                migs.setdefault(d.mig_uuid, []).append(d.cuda_index)
        return cls(view.cuda_indices(), migs)


def _cuda_cell(indices: list[int]) -> str:
    return ",".join(f"cuda:{i}" for i in indices) or "-"


def _rows(
    inv: Inventory,
    cuda: _CudaNumbers | None,
    claims: Mapping[str, Holder] | None,
    *,
    compact: bool,
) -> list[_Row]:
    """One row per GPU, then its MIG instances, with the cells ``_headers`` names."""
    rows: list[_Row] = []

    def add(
        index: str,
        cuda_ids: list[int] | None,
        name: str,
        memory: str,
        readings: list[str],
        uuid: str,
        procs: tuple[GpuProcess, ...],
        style: str = "",
    ) -> None:
        cells = [index]
        if cuda is not None:
            cells.append(_cuda_cell(cuda_ids or []))
        cells += [name, memory, *(readings[:2] if compact else readings)]
        if claims is not None:
            holder = claims.get(uuid)
            cells.append("-" if holder is None else _holder(holder, compact=compact))
        cells.append(", ".join(_process_line(p, compact=compact) for p in procs) or "-")
        rows.append(_Row(cells, style))

    for gpu in inv.gpus:
        readings = [na(gpu.utilization_gpu, "{}%"), na(gpu.temperature_c, "{}°C"), _power(gpu)]
        # On a MIG GPU the processes are shown under the instance they run in.
        add(
            str(gpu.index),
            None if cuda is None else cuda.gpus.get(gpu.index, []),
            _short_name(gpu.name) if gpu.error is None else f"unreadable: {gpu.error}",
            _memory(gpu.memory_used, gpu.memory_total, compact=compact),
            readings,
            gpu.uuid,
            () if gpu.mig_instances else gpu.processes,
            style="" if gpu.error is None else "red",
        )
        for mig in gpu.mig_instances:
            add(
                f"{gpu.index}.{mig.index}",
                None if cuda is None else cuda.migs.get(mig.uuid, []),
                f"└ {_short_name(mig.name or 'MIG', gpu.name)}",
                _memory(mig.memory_used, mig.memory_total, compact=compact),
                ["", "", ""],
                mig.uuid,
                mig.processes,
                style="dim",
            )
    return rows


def _show_cuda(view: VisibleDevices) -> bool:
    # CUDA's numbers are worth a column when they can differ from nvidia-smi's.
    return view.restricted or any(d.cuda_index != d.nvml_index for d in view.devices or ())


def _natural_widths(headers: list[str], rows: list[_Row]) -> list[int]:
    from rich.cells import cell_len

    widths = [cell_len(h) for h in headers]
    for row in rows:
        if row.message is None and not row.section:
            widths = [max(w, cell_len(c)) for w, c in zip(widths, row.cells, strict=True)]
    return widths


def _fit(headers: list[str], natural: list[int], width: int) -> dict[int, int]:
    """Widths of the free-text columns so that the table is ``width`` wide, where it can be.

    The readings keep their width; the name (and host) give way first, down to a few
    characters; the holder and the processes share what is left, each keeping its own
    width when the other needs less.
    """
    cut = [i for i, h in enumerate(headers) if h in _CUT]
    left = width - _GAP * (len(headers) - 1) - sum(w for i, w in enumerate(natural) if i not in cut)
    shared = [i for i in cut if headers[i] not in _GIVE_WAY]
    widths: dict[int, int] = {}
    for i in cut:
        if i not in shared:
            floor = min(natural[i], _GIVE_WAY[headers[i]])
            room = left - sum(natural[j] for j in cut if j != i and j not in widths)
            widths[i] = max(floor, min(natural[i], room))
            left -= widths[i]
    for n, i in enumerate(shared):
        others = sum(natural[j] for j in shared[n + 1 :])
        share = left // (len(shared) - n)
        widths[i] = max(min(natural[i], max(share, left - others)), 8)
        left -= widths[i]
    return widths


def _cell(text: str, width: int, *, right: bool) -> str:
    from rich.cells import cell_len, set_cell_size

    if cell_len(text) > width:
        text = set_cell_size(text, max(width - 1, 0)) + "…"
    pad = " " * (width - cell_len(text))
    return pad + text if right else text + pad


def _lines(headers: list[str], rows: list[_Row], widths: list[int]) -> Iterator[Text]:
    """The table as lines of text: the header, then each row, a blank line between hosts.

    Drawn here rather than by rich's Table, whose layout costs milliseconds a row: a table of
    many hosts stays quick to print, in time linear in its rows.
    """
    from rich.text import Text

    right = [h in _RIGHT for h in headers]
    gap = " " * _GAP

    def line(row: _Row) -> str:
        parts = [_cell(c, w, right=r) for c, w, r in zip(row.cells, widths, right, strict=False)]
        if row.message is not None:  # said whole; the line is cut only at the terminal's edge
            parts.append(row.message)
        return gap.join(parts).rstrip()

    # Text, not markup: a command line such as `train.py tags=[/x]` is shown as it is (as a
    # markup string it would vanish or raise, and any user can start such a process).
    yield Text(line(_Row(headers)), style="bold", no_wrap=True, overflow="ellipsis")
    for row in rows:
        if row.section:
            yield Text("")
            continue
        # Every row has the cells its headers name: one more would be a column with no header.
        assert row.message is not None or len(row.cells) == len(headers), (headers, row.cells)
        yield Text(line(row), style=row.style, no_wrap=True, overflow="ellipsis")


class GpuTable:
    """A rich renderable that draws the full layout where it fits, else the compact one."""

    def __init__(self, build: _Build) -> None:
        self._build = build

    def layout(self, width: int) -> tuple[list[str], list[_Row], list[int]]:
        """Headers, rows and column widths at ``width`` columns: the full layout if it fits,
        else the compact one, its free-text columns cut to fit."""
        headers, rows = self._build(False)
        natural = _natural_widths(headers, rows)
        if sum(natural) + _GAP * (len(natural) - 1) <= width:
            return headers, rows, natural
        headers, rows = self._build(True)
        natural = _natural_widths(headers, rows)
        fit = _fit(headers, natural, width)
        return headers, rows, [fit.get(i, w) for i, w in enumerate(natural)]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        yield from _lines(*self.layout(options.max_width))

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        from rich.cells import cell_len
        from rich.measure import Measurement

        widest = max(cell_len(line.plain) for line in _lines(*self.layout(options.max_width)))
        return Measurement(min(widest, 20), widest)


def build_table(
    inv: Inventory,
    view: VisibleDevices,
    *,
    claims: Mapping[str, Holder] | None = None,
) -> GpuTable:
    """The table of GPUs; ``claims`` (GPU UUID -> holder) adds a "claimed by" column."""
    cuda = _CudaNumbers.of(view) if _show_cuda(view) else None

    def build(compact: bool) -> tuple[list[str], list[_Row]]:
        headers = _headers(cuda=cuda is not None, claims=claims is not None, compact=compact)
        return headers, _rows(inv, cuda, claims, compact=compact)

    return GpuTable(build)


def build_hosts_table(readings: Sequence[HostReading]) -> GpuTable:
    """One table of several machines' GPUs, a section per host; a failed host shows why.

    GPUs are numbered as nvidia-smi numbers them on their host: CUDA's numbering there depends
    on each process's environment, which cannot be known from here. Linear in the number of
    GPUs (each host holds at most :data:`gpukit.gpus.hosts.MAX_GPUS`).
    """

    def build(compact: bool) -> tuple[list[str], list[_Row]]:
        headers = ["host", *_headers(cuda=False, claims=True, compact=compact)]
        rows: list[_Row] = []
        for i, reading in enumerate(readings):
            if i:
                rows.append(_Row([], section=True))
            if reading.inventory is None:
                # The reason runs on from the name column, whole, without widening a column.
                message = reading.error or "no answer"
                rows.append(_Row([reading.host, "-"], "red", message=message))
                continue
            for j, row in enumerate(
                _rows(reading.inventory, None, reading.claims, compact=compact)
            ):
                host = reading.host if j == 0 else ""
                rows.append(_Row([host, *row.cells], row.style))
        return headers, rows

    return GpuTable(build)
