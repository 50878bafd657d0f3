"""Shared rendering for the commands: consoles that respect NO_COLOR and pipes, JSON output."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from gpukit.errors import GpukitError


def console(*, stderr: bool = False) -> Console:
    """A rich console for human output.

    rich already honours ``NO_COLOR`` and drops colour and live updates when the stream is not
    a terminal, so a log or a pipe receives plain lines.
    """
    import os

    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich exits with status 1 when the reader leaves (`gpukit list --watch | head`),
            # the code of an internal failure; let the command end as a finished pipe does.
            self.quiet = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise BrokenPipeError

    stream = sys.stderr if stderr else sys.stdout
    # A log or a pipe has no width: don't fold tables to rich's 80-column default there.
    width = None if stream.isatty() or "COLUMNS" in os.environ else 160
    # markup off: what gpukit prints is data (paths, commands, metadata) in which a "[...]"
    # must show as written, never be read as a style.
    return _Console(stderr=stderr, highlight=False, soft_wrap=False, width=width, markup=False)


def print_json(payload: dict[str, Any]) -> None:
    """Print ``payload`` (which carries its own ``schema`` field) as JSON on stdout.

    Non-finite numbers are written as ``null``: ``NaN`` and ``Infinity`` are not JSON, and a
    strict reader (``jq``, JavaScript) refuses the whole document for one of them.
    """
    from gpukit.output import dumps

    sys.stdout.write(dumps(payload, indent=2, default=str) + "\n")


def na(value: object, fmt: str = "{}") -> str:
    """Format a reading, or ``n/a`` when the device could not give it."""
    return "n/a" if value is None else fmt.format(value)


def human_bytes(n: float | None) -> str:
    """``1536 -> '1.5 KiB'`` (:func:`gpukit.sizes.format_size`); ``None -> 'n/a'``."""
    from gpukit.sizes import format_size

    return "n/a" if n is None else format_size(n)


def say_if_fake(command: str) -> None:
    """Say on stderr when GPUKIT_FAKE_NVML makes ``gpukit COMMAND`` read a described machine.

    A forgotten ``export GPUKIT_FAKE_NVML=...`` must not quietly hand out another machine's
    GPU indices.
    """
    import os

    fake = os.environ.get("GPUKIT_FAKE_NVML")
    if fake:
        print(
            f"gpukit {command}: reading a fake machine from {fake} (GPUKIT_FAKE_NVML).",
            file=sys.stderr,
        )


def print_error(command: str, exc: GpukitError) -> int:
    """Print ``exc`` on stderr as its message, one line per GPU, then the next step."""
    print(f"gpukit {command}: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(exc.hint, file=sys.stderr)
    return int(exc.exit_code)
