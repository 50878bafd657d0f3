"""``gpukit queue``: who holds which GPU, who waits and why, unclaimed and idle use.

    gpukit queue                 # tables
    gpukit queue --json          # schema gpukit.queue/1
    gpukit queue --watch         # refreshed every 2 s until Ctrl-C

Never imports torch, and imports rich only for human output, so that it starts fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from gpukit.cli._args import Seconds, add_watch
from gpukit.cli._output import human_bytes, na, print_json, say_if_fake
from gpukit.output import dumps
from gpukit.sharing.report import IDLE_AFTER_S, Sharing, sharing
from gpukit.untrusted import printable

if TYPE_CHECKING:
    from rich.console import Console, RenderableType


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit queue``."""
    parser.add_argument("--json", action="store_true", help="print JSON (schema gpukit.queue/1)")
    add_watch(parser)
    parser.add_argument(
        "--idle-after",
        type=Seconds(positive=True, unit="minutes"),
        default=IDLE_AFTER_S / 60,
        metavar="MIN",
        help="call a claim idle after MIN minutes with no process and 0%% utilisation on its "
        f"GPUs ({IDLE_AFTER_S / 60:g})",
    )


def _ago(then: float | None, now: float) -> str:
    if then is None:
        return "n/a"
    return _duration(now - then)


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _gpus(indices: tuple[int | None, ...]) -> str:
    return ",".join("?" if i is None else str(i) for i in indices) or "-"


def _render(state: Sharing) -> RenderableType:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = state.taken_at
    parts: list[RenderableType] = [
        Text(
            f"{time.strftime('%H:%M:%S', time.localtime(now))} · {len(state.holders)} "
            f"claim{'s' * (len(state.holders) != 1)} · {len(state.waiters)} "
            f"waiting · idle after {_duration(state.idle_after_s)}",
            style="dim",
        )
    ]

    def table(title: str, columns: list[str], rows: list[list[str]], empty: str) -> None:
        if not rows:
            parts.append(Text(f"{title}: {empty}", style="dim"))
            return
        out = Table(title=title, title_justify="left", box=None, pad_edge=False)
        for column in columns:
            out.add_column(column, overflow="fold" if column == "command" else "ellipsis")
        for row in rows:
            out.add_row(*row)
        parts.append(out)

    table(
        "holders",
        ["gpus", "user", "pid", "for", "command"],
        [
            [_gpus(h.gpus), na(h.user), na(h.pid), _ago(h.since, now), na(h.command)]
            for h in state.holders
        ],
        "no GPU is claimed",
    )
    table(
        "waiters",
        ["#", "user", "pid", "n", "criteria", "for", "why not yet", "command"],
        [
            [
                str(w.position),
                na(w.user),
                na(w.pid),
                na(w.n),
                na(w.criteria),
                _ago(w.since, now),
                w.reason,
                na(w.command),
            ]
            for w in state.waiters
        ],
        "nobody is waiting",
    )
    table(
        "unclaimed use",
        ["gpu", "user", "pid", "memory", "command"],
        [
            [str(u.gpu), na(u.user), str(u.pid), human_bytes(u.memory), na(u.command)]
            for u in state.unclaimed
        ],
        "every process on a GPU is covered by a claim",
    )
    table(
        "idle claims",
        ["gpus", "user", "pid", "idle for", "command"],
        [
            [_gpus(i.gpus), na(i.user), na(i.pid), _duration(i.idle_s), na(i.command)]
            for i in state.idle
        ],
        f"no claim idle for more than {_duration(state.idle_after_s)}",
    )
    if state.foreign:  # rare, and worth a look: planted links, FIFOs, forged tickets
        table(
            "not waiters (in the queue folder)",
            ["name", "why"],
            # Names any user chose: no control character reaches the terminal.
            [[printable(f.name) or "?", f.why] for f in state.foreign],
            "",
        )
    if state.foreign_not_listed:
        parts.append(
            Text(
                f"not waiters: {state.foreign_not_listed} more not listed (the first "
                f"{len(state.foreign)} by name are shown)",
                style="dim",
            )
        )
    return Group(*parts)


def _print(out: Console, renderable: RenderableType) -> None:
    if not out.is_terminal:
        wide = out.options.update_width(10_000)
        out.width = max(out.width, out.measure(renderable, options=wide).maximum)
    out.print(renderable)


def _watch(args: argparse.Namespace, idle_after: float) -> int:
    from rich.live import Live

    from gpukit.cli._output import console

    out = console()
    interval = max(float(args.watch), 0.05)
    try:
        if args.json or not out.is_terminal:
            while True:
                state = sharing(idle_after=idle_after)
                if args.json:
                    sys.stdout.write(dumps(state.to_json(), default=str) + "\n")
                    sys.stdout.flush()
                else:
                    _print(out, _render(state))
                time.sleep(interval)
        with Live(
            _render(sharing(idle_after=idle_after)),
            console=out,
            auto_refresh=False,
            transient=False,
        ) as live:
            while True:
                time.sleep(interval)
                live.update(_render(sharing(idle_after=idle_after)), refresh=True)
    except KeyboardInterrupt:
        return 0


def run(args: argparse.Namespace) -> int:
    """Print the sharing state once, or keep a live view with ``--watch``."""
    say_if_fake("queue")
    idle_after = args.idle_after * 60
    if args.watch is not None:
        return _watch(args, idle_after)
    state = sharing(idle_after=idle_after)
    if args.json:
        print_json(state.to_json())
        return 0
    from gpukit.cli._output import console

    _print(console(), _render(state))
    return 0
