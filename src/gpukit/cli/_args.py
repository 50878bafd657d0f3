"""The one checked reader of the numbers, sizes, durations and output files that options take.

Every command's options use these as argparse ``type=`` functions, so a bad value is refused
while the arguments are parsed, before any work starts, as a usage error (exit 2) that says what
was given and what is accepted, never a traceback. What is refused everywhere: ``nan`` and
``inf``, numbers too large to mean anything (``--min-free`` with 400 digits), digits that are
not ASCII (``²``, ``٣``), and output files in folders that do not exist or cannot be written.

>>> Number(minimum=1)("4")
4
>>> Seconds(positive=True)("0.5")
0.5

Never imports torch.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from gpukit.errors import InvalidArgumentError
from gpukit.untrusted import MAX_SECONDS

__all__ = ["Number", "OutputFile", "Percent", "Seconds", "ShardSize", "Size"]

_MAX_TEXT = 64  # characters: more is never a number a person meant
_INTEGER = re.compile(r"[+-]?[0-9]+")
_PLAIN = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")  # a number, as a size without its unit
_REAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _shown(text: str) -> str:
    return repr(text if len(text) <= 24 else text[:20] + f"... ({len(text)} characters)")


def _refuse(text: str, what: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{_shown(text)} is not {what}.")


def _real(text: str, what: str) -> float:
    """A finite float written with ASCII digits, or ArgumentTypeError naming ``what``."""
    cleaned = text.strip()
    if len(cleaned) > _MAX_TEXT or not _REAL.fullmatch(cleaned):
        raise _refuse(text, what)
    value = float(cleaned)
    if not math.isfinite(value):  # 1e400
        raise _refuse(text, what)
    return value


@dataclass(frozen=True)
class Number:
    """A whole number from ``minimum`` to ``maximum`` (``-n 2``, ``--settle 3``, ``--seed 0``)."""

    minimum: int = 0
    maximum: int = 1_000_000

    def __call__(self, text: str) -> int:
        what = f"a whole number from {self.minimum} to {self.maximum:,}"
        cleaned = text.strip()
        if len(cleaned) > _MAX_TEXT or not _INTEGER.fullmatch(cleaned):
            raise _refuse(text, what)
        value = int(cleaned)
        if not self.minimum <= value <= self.maximum:
            raise _refuse(text, what)
        return value


@dataclass(frozen=True)
class Seconds:
    """A duration: finite, at most a year, above 0 when ``positive``.

    In seconds, or in ``unit`` ("minutes") where an option counts in it (``--idle-after 30``).
    """

    positive: bool = False
    unit: str = "seconds"

    def __call__(self, text: str) -> float:
        floor = "above 0" if self.positive else "0 or more"
        what = f"a number of {self.unit} ({floor}, at most a year)"
        value = _real(text, what)
        per_unit = {"seconds": 1, "minutes": 60}[self.unit]
        if value < 0 or (self.positive and value == 0) or value * per_unit > MAX_SECONDS:
            raise _refuse(text, what)
        return value


@dataclass(frozen=True)
class Percent:
    """A percentage from 0 to 100 (``--max-util 10``)."""

    def __call__(self, text: str) -> float:
        what = "a percentage from 0 to 100"
        value = _real(text, what)
        if not 0 <= value <= 100:
            raise _refuse(text, what)
        return value


@dataclass(frozen=True)
class Size:
    """A memory size with its unit (``20GiB``, ``500MB``, ``512B``) as gk.pick reads it;
    returned as written.

    A number without a unit is refused: ``--min-free 20`` would be 20 bytes, which nobody
    means, and gk.pick cannot tell.
    """

    def __call__(self, text: str) -> str:
        from gpukit.sizes import parse_size

        cleaned = text.strip()
        if len(cleaned) > _MAX_TEXT:
            raise _refuse(text, 'a memory size such as "20GiB" or "500MB"')
        if _PLAIN.fullmatch(cleaned):
            raise argparse.ArgumentTypeError(
                f"{_shown(text)} has no unit: did you mean {cleaned}GiB? Write a size with its "
                f'unit, e.g. "{cleaned}GiB", "{cleaned}MB" or, in bytes, "{cleaned}B".'
            )
        try:
            parse_size(text)
        except InvalidArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text


@dataclass(frozen=True)
class ShardSize:
    """The largest shard of a checkpoint folder (``2GB``, ``1.5G``, ``500MiB``, or bytes:
    ``4096``), as gk.save's ``max_shard_size`` reads it; returned as written.

    A number without a unit is bytes here, as in Hugging Face's ``max_shard_size``.
    """

    def __call__(self, text: str) -> str:
        from gpukit.sizes import parse_shard_size

        if len(text.strip()) > _MAX_TEXT:
            raise _refuse(text, 'a shard size such as "2GB" or "500MiB"')
        try:
            parse_shard_size(text, option=None)
        except InvalidArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text


@dataclass(frozen=True)
class OutputFile:
    """A file the command will write at the end: its folder must exist and be writable now.

    Checked when the arguments are parsed, so a typo in a folder name is found before a long
    run, not after it. An existing folder or symbolic link at the path itself is refused too.
    """

    def __call__(self, text: str) -> str:
        if not text or "\0" in text:
            raise argparse.ArgumentTypeError(f"{text!r} is not a file name.")
        try:
            problem = self._problem(Path(text))
        except OSError as exc:  # a name too long, a loop of links...
            problem = f"cannot write {_shown(text)}: {exc.strerror or exc}."
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return text

    @staticmethod
    def _problem(path: Path) -> str | None:
        folder = path.parent
        if path.is_symlink():
            # In a folder others can write (/tmp), a link may have been planted to make gpukit
            # overwrite one of your files through it.
            return (
                f"{path} is a symbolic link, and gpukit does not write through links. Name the "
                "file itself, or remove the link."
            )
        if path.is_dir():
            return (
                f"{path} is an existing folder, and the output is one file: name a file, e.g. "
                f"{path / 'out'}."
            )
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            return (
                f"cannot write {path}: the folder {folder} {what}. Create it first, or name a "
                "file in an existing folder."
            )
        if not os.access(folder, os.W_OK | os.X_OK):
            return (
                f"cannot write {path}: the folder {folder} is not writable by you. Name a file "
                "in a folder you can write."
            )
        return None


def add_watch(parser: argparse.ArgumentParser) -> None:
    """``--watch [SECONDS]``: the live view that ``gpukit list`` and ``gpukit queue`` share."""
    parser.add_argument(
        "--watch",
        nargs="?",
        type=Seconds(positive=True),
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C; with --json, one document a line",
    )
