"""The one layer for everything gpukit reads that someone else controls.

Another user writes tickets, holder records, ledgers and ``policy.toml`` into the shared lock
folder; another host answers ``gpukit list --hosts``; a stranger's checkpoint carries headers,
index files and pickled metadata. Every reader of such data goes through this module, which
holds these rules:

- **Bounded.** Nothing is read past a stated number of bytes (:func:`read_bounded`,
  :func:`read_file`); parsed documents are refused past a stated nesting depth and number of
  entries (:func:`parse_json`, :func:`parse_toml`).
- **Every failure is one failure.** Whatever goes wrong while parsing (``RecursionError``,
  ``OverflowError``, ``MemoryError`` within the bounds, a decoding error, a wrong type, a
  non-finite number, an integer out of range) is an :class:`InvalidInput`, which each reader maps
  to its own result ("?", "not a waiter", a typed gpukit error). Never a traceback.
- **Opened one way.** A file in a folder others can write is opened without following a link,
  without blocking on a FIFO, and checked by ``fstat`` to be a regular file before one byte is
  read (:func:`open_regular`).
- **Checked by type and value.** ``type(x) is str``, never ``str(x)`` of an object someone else
  built (:func:`as_str`, :func:`as_int`, :func:`as_float`, :func:`as_list`, :func:`as_dict`).
- **Printable.** A string from others reaches a terminal, a page or a metric only through
  :func:`printable`: control characters (escape sequences, OSC titles, hyperlinks, clear screen)
  become ``?``.

What gpukit writes where others read it (finite JSON, files put in place in one step) is
:mod:`gpukit.output`'s.

This module must not import torch: every command reads the lock folder.

>>> parse_json(b'{"pid": 12}', limit=1024)
{'pid': 12}
>>> parse_json(b"[" * 100000, limit=1 << 20)
Traceback (most recent call last):
    ...
gpukit.untrusted.InvalidInput: not valid JSON: nested more than 32 deep
>>> printable("\\x1b]0;owned\\x07alice") == "?]0;owned?alice"
True
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "DEPTH",
    "MAX_SECONDS",
    "InvalidInput",
    "Streams",
    "as_dict",
    "as_float",
    "as_int",
    "as_list",
    "as_str",
    "open_regular",
    "parse_json",
    "parse_toml",
    "printable",
    "read_bounded",
    "read_file",
    "read_streams",
]

DEPTH = 32
"""The deepest nesting any document gpukit reads from others may have. gpukit's own records
are at most four deep; a limit far below the interpreter's recursion limit keeps every walk
over a parsed document safe."""

_FLOAT_MAX = sys.float_info.max
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class InvalidInput(ValueError):
    """Data from someone else that gpukit refuses: too large, too deep, malformed, wrong type.

    The message says what was wrong, never echoing the data itself, so that it can be shown
    as it is.
    """


# --- reading bytes -------------------------------------------------------------------------


def read_bounded(fd: int, limit: int) -> bytes:
    """At most ``limit`` bytes from ``fd``; :class:`InvalidInput` if there are more.

    Reads incrementally (never asks the kernel for more than one chunk past the limit), so a
    file that claims or holds gigabytes costs ``limit`` bytes of memory at most.

    Args:
        fd: an open descriptor to read from, left open.
        limit: the most bytes accepted, 0 or more.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = os.read(fd, min(1 << 20, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise InvalidInput(f"larger than {limit} bytes")


def open_regular(
    path: str | os.PathLike[str],
    *,
    dir_fd: int | None = None,
    follow: bool = False,
    nlink: bool = False,
) -> int:
    """A read-only descriptor of ``path``, checked to be a regular file, or :class:`InvalidInput`.

    Opened with ``O_NOFOLLOW`` (unless ``follow``: a link the caller has decided to accept, such
    as a Hugging Face cache snapshot's link into ``blobs/``), ``O_NONBLOCK`` (a FIFO cannot hang
    the open) and ``O_CLOEXEC``; then ``fstat`` must show a regular file, and with ``nlink``
    exactly one link. ``dir_fd`` opens ``path`` relative to a folder already opened and checked.
    ``OSError`` is left to the caller, who knows what a missing file means there.

    Args:
        path: the file to open.
        dir_fd: a descriptor of the folder ``path`` is relative to; None: the working folder.
        follow: whether a symbolic link at ``path`` is followed (False: refused).
        nlink: whether a file with more than one hard link is refused (False: accepted).
    """
    flags = _OPEN_FLAGS & ~os.O_NOFOLLOW if follow else _OPEN_FLAGS
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == getattr(os, "ELOOP", 40):
            raise InvalidInput("a symbolic link, not a file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidInput(f"{_kind(info.st_mode)}, not a regular file")
        if nlink and info.st_nlink != 1:
            raise InvalidInput(f"a file with {info.st_nlink} links (hard-linked), not one")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(
    path: str | os.PathLike[str],
    limit: int,
    *,
    dir_fd: int | None = None,
    follow: bool = False,
    nlink: bool = False,
) -> bytes:
    """The whole content of a regular file, opened as :func:`open_regular` does, at most
    ``limit`` bytes (:class:`InvalidInput` past it). ``OSError`` is left to the caller.

    Args:
        path: the file to read.
        limit: the most bytes accepted, 0 or more.
        dir_fd: a descriptor of the folder ``path`` is relative to; None: the working folder.
        follow: whether a symbolic link at ``path`` is followed (False: refused).
        nlink: whether a file with more than one hard link is refused (False: accepted).
    """
    fd = open_regular(path, dir_fd=dir_fd, follow=follow, nlink=nlink)
    try:
        return read_bounded(fd, limit)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


# --- parsing documents -----------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise InvalidInput(f"not valid JSON: {name} is not a number gpukit accepts")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidInput("not valid JSON: a number too large to be finite")
    return value


def parse_json(data: bytes | str, *, limit: int, depth: int = DEPTH) -> object:
    """The JSON document in ``data``, or :class:`InvalidInput`.

    Refused: more than ``limit`` bytes (checked before parsing), anything the parser rejects,
    text that is not UTF-8, ``NaN``/``Infinity`` and numbers that overflow to them, integers
    of more digits than Python converts, and nesting deeper than ``depth``. Nesting is checked
    *before* the parser recurses, so ``[[[[...`` a million deep costs one linear scan.

    Args:
        data: the document, as bytes (UTF-8) or text.
        limit: the most bytes (or characters, for text) accepted.
        depth: the deepest nesting of arrays and objects accepted (:data:`DEPTH`, 32).
    """
    if len(data) > limit:
        raise InvalidInput(f"larger than {limit} bytes")
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
    except UnicodeDecodeError:
        raise InvalidInput("not valid JSON: not UTF-8 text") from None
    _check_json_depth(text, depth)
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except InvalidInput:
        raise
    except (ValueError, RecursionError, OverflowError, MemoryError, TypeError) as error:
        raise InvalidInput(f"not valid JSON: {type(error).__name__}") from None


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def _check_json_depth(text: str, depth: int) -> None:
    """Refuse brackets nested more than ``depth`` deep, outside strings, in one pass.

    Strings are cut out first (one regular-expression pass in C), then only the brackets are
    looked at, so the cost stays linear and small whatever the document holds.
    """
    level = 0
    for match in _BRACKET.finditer(_STRING.sub("", text)):
        if match.group() in "[{":
            level += 1
            if level > depth:
                raise InvalidInput(f"not valid JSON: nested more than {depth} deep")
        else:
            level -= 1


def parse_toml(data: bytes | str, *, limit: int, depth: int = DEPTH) -> dict[str, Any]:
    """The TOML document in ``data``, or :class:`InvalidInput`.

    The same refusals as :func:`parse_json`: size before parsing, any parser failure (the
    standard library's parser recurses on nested arrays and inline tables), non-finite floats
    (TOML allows ``inf`` and ``nan``), and nesting deeper than ``depth``.

    Args:
        data: the document, as bytes (UTF-8) or text.
        limit: the most bytes (or characters, for text) accepted.
        depth: the deepest nesting of arrays and tables accepted (:data:`DEPTH`, 32).
    """
    if len(data) > limit:
        raise InvalidInput(f"larger than {limit} bytes")
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
    except UnicodeDecodeError:
        raise InvalidInput("not valid TOML: not UTF-8 text") from None
    _check_json_depth(text.replace("'", '"'), depth)  # brackets and braces nest in TOML too
    try:
        document = tomllib.loads(text, parse_float=_finite_toml_float)
    except InvalidInput:
        raise
    except (ValueError, RecursionError, OverflowError, MemoryError, TypeError) as error:
        raise InvalidInput(f"not valid TOML: {type(error).__name__}") from None
    _check_depth(document, depth)
    return dict(document)


def _finite_toml_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidInput("not valid TOML: a number that is not finite")
    return value


def _check_depth(value: object, depth: int) -> None:
    """Refuse a parsed document nested more than ``depth`` deep, without recursing."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if level > depth:
            raise InvalidInput(f"nested more than {depth} deep")
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)


# --- checking values -------------------------------------------------------------------------


def as_str(value: object, *, limit: int = 4096, what: str = "a field") -> str:
    """``value`` if it is exactly a ``str`` of at most ``limit`` characters.

    Anything else is an :class:`InvalidInput`.

    ``type(value) is str``: a ``str`` subclass built by an unpickler can override ``__str__``,
    ``__fspath__`` or ``__eq__``; only the real type behaves as checked.

    Args:
        value: the value to check.
        limit: the most characters accepted (4096).
        what: what the value is, for the message (``"a field"``).
    """
    if type(value) is not str:
        raise InvalidInput(f"{what} is not a string")
    if len(value) > limit:
        raise InvalidInput(f"{what} is longer than {limit} characters")
    return value


def as_int(value: object, *, low: int = 0, high: int = (1 << 63) - 1, what: str = "a field") -> int:
    """``value`` if it is exactly an ``int`` (not a bool) in ``[low, high]``; else
    :class:`InvalidInput`.

    Args:
        value: the value to check.
        low: the smallest value accepted (0).
        high: the largest value accepted (``2**63 - 1``).
        what: what the value is, for the message (``"a field"``).
    """
    if type(value) is not int:
        raise InvalidInput(f"{what} is not an integer")
    if not low <= value <= high:
        raise InvalidInput(f"{what} is out of range ({low} to {high})")
    return value


def as_float(
    value: object, *, low: float = -math.inf, high: float = math.inf, what: str = "a field"
) -> float:
    """``value`` as a finite float in ``[low, high]`` if it is an ``int`` or ``float``; else
    :class:`InvalidInput`.

    Compared before any conversion: ``float()`` of a 400-digit integer raises ``OverflowError``.

    Args:
        value: the value to check.
        low: the smallest value accepted (no bound).
        high: the largest value accepted (no bound).
        what: what the value is, for the message (``"a field"``).
    """
    if type(value) not in (int, float):
        raise InvalidInput(f"{what} is not a number")
    assert isinstance(value, int | float)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidInput(f"{what} is not finite")
    if not low <= value <= high:
        raise InvalidInput(f"{what} is out of range")
    if isinstance(value, int) and abs(value) > _FLOAT_MAX:
        raise InvalidInput(f"{what} is too large to be a finite number")
    return float(value)


def as_list(value: object, *, limit: int = 4096, what: str = "a field") -> list[Any]:
    """``value`` if it is exactly a ``list`` of at most ``limit`` items; else
    :class:`InvalidInput`.

    Args:
        value: the value to check; its items are not checked.
        limit: the most items accepted (4096).
        what: what the value is, for the message (``"a field"``).
    """
    if type(value) is not list:
        raise InvalidInput(f"{what} is not a list")
    if len(value) > limit:
        raise InvalidInput(f"{what} has more than {limit} items")
    return value


def as_dict(value: object, *, limit: int = 4096, what: str = "a field") -> dict[str, Any]:
    """``value`` if it is exactly a ``dict`` with ``str`` keys and at most ``limit`` entries,
    else :class:`InvalidInput`.

    Args:
        value: the value to check; its values are not checked.
        limit: the most entries accepted (4096).
        what: what the value is, for the message (``"a field"``).
    """
    if type(value) is not dict:
        raise InvalidInput(f"{what} is not a mapping")
    if len(value) > limit:
        raise InvalidInput(f"{what} has more than {limit} entries")
    if not all(type(key) is str for key in value):
        raise InvalidInput(f"{what} has a key that is not a string")
    return value


def printable(text: object, *, limit: int = 500) -> str | None:
    """``text`` cut to ``limit`` characters, each control character as ``?``; None if it is not
    a string or is empty.

    Anything another user, another host or a stranger's file chose (a command line, a GPU
    name, a user name) reaches a terminal, a page or a metric only through this function, so
    that no escape sequence (cursor moves, colours, OSC titles and hyperlinks, clear screen) is
    ever passed on.

    Args:
        text: the value to show; anything but a non-empty ``str`` gives None.
        limit: the most characters kept (500).
    """
    if type(text) is not str or not text:
        return None
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


# --- reading streams -------------------------------------------------------------------------


@dataclass(frozen=True)
class Streams:
    """What :func:`read_streams` read: each stream's bytes, and why it stopped early if it did.

    Args:
        data: each stream's bytes, in the order given.
        over_limit: the position of the first stream that passed its limit; None: none did.
        timed_out: whether the time ran out before every stream ended.
    """

    data: tuple[bytes, ...]
    """Each stream's bytes, in the order given; at most its limit (plus one chunk) each."""
    over_limit: int | None = None
    """The position of the first stream that passed its limit, else ``None``."""
    timed_out: bool = False
    """True when the time ran out before every stream ended."""

    @property
    def complete(self) -> bool:
        """True when every stream ended within its limit and the time."""
        return self.over_limit is None and not self.timed_out


def read_streams(fds: Sequence[int], limits: Sequence[int], *, timeout: float) -> Streams:
    """Read the pipes ``fds`` to their ends at once, at most ``limits[i]`` bytes each, within
    ``timeout`` seconds.

    For the output of another machine's command (an ssh): a stream that never ends or never
    stops costs at most its limit in memory and ``timeout`` in time. Reading stops at the first
    stream past its limit or when the time is up, and :class:`Streams` says which; the caller
    then kills the writer. The descriptors are left open.

    Args:
        fds: the descriptors to read, pipes or sockets.
        limits: the most bytes accepted from each, in the order of ``fds``.
        timeout: the most seconds the reading takes.

    >>> import os
    >>> r, w = os.pipe()
    >>> _ = os.write(w, b"x" * 100); os.close(w)
    >>> read_streams([r], [10], timeout=5).over_limit
    0
    """
    import selectors
    import time

    data = [bytearray() for _ in fds]
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for i, fd in enumerate(fds):
            selector.register(fd, selectors.EVENT_READ, i)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return Streams(tuple(map(bytes, data)), timed_out=True)
            for key, _ in selector.select(left):
                i = key.data
                chunk = os.read(key.fd, min(1 << 16, limits[i] + 1 - len(data[i])))
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                data[i] += chunk
                if len(data[i]) > limits[i]:
                    return Streams(tuple(map(bytes, data)), over_limit=i)
    return Streams(tuple(map(bytes, data)))


MAX_SECONDS = 366 * 86400.0
"""The longest duration gpukit takes anywhere, from an option, a variable or an argument: a
year. Past it a number of seconds is a typo, and ``time.sleep`` overflows past ~292 years."""
