"""What gpukit writes where others read it: JSON that every reader can parse, and files put in
place in one step.

- **Finite out.** The JSON gpukit prints or writes (``--json`` outputs, ``/api/``, ledgers,
  save markers) holds no ``NaN`` or ``Infinity``, which many readers refuse (:func:`json_safe`,
  :func:`dumps`).
- **Written in one step.** An output named long before it is written, in a folder others may
  write, is put in place by :func:`write_output`: never through a link, never into a FIFO, and
  fsynced before it is renamed over the name.

Its reading twin is :mod:`gpukit.untrusted`; like it, this module imports no torch.

>>> dumps({"power": float("nan"), "gpus": (0, 1)})
'{"power": null, "gpus": [0, 1]}'
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

from gpukit.untrusted import DEPTH, InvalidInput

__all__ = ["dumps", "json_safe", "write_output"]


def json_safe(value: object, *, _depth: int = 0) -> object:
    """``value`` with every non-finite float (``nan``, ``inf``) replaced by ``None``, so that
    the JSON gpukit prints is valid JSON for every reader (``--json`` outputs, ``/api/``).

    Tuples become lists; :class:`InvalidInput` past ``4 * DEPTH`` levels of nesting.

    Args:
        value: the value to clean, walked through its dicts, lists and tuples.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if _depth > 4 * DEPTH:
        raise InvalidInput("nested too deep to write")
    if isinstance(value, dict):
        return {k: json_safe(v, _depth=_depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v, _depth=_depth + 1) for v in value]
    return value


def dumps(value: object, *, default: Callable[[Any], Any] | None = None, **options: Any) -> str:
    """``json.dumps`` of :func:`json_safe` ``(value)``, refusing (never writing) ``NaN``.

    Args:
        value: the value to write.
        default: what ``json.dumps`` calls for an object it cannot write; None: a ``TypeError``.
        **options: further ``json.dumps`` options (``indent``, ``sort_keys``...).
    """
    return json.dumps(json_safe(value), allow_nan=False, default=default, **options)


def write_output(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644) -> None:
    """Put ``data`` at ``path`` in one step, never through a link and never into a FIFO.

    For an output named long before it is written (``gpukit bench --json/--plot`` after the
    whole run), in a folder others may write: the folder is opened once, a new temporary file
    is created in it with ``O_EXCL | O_NOFOLLOW`` (``mode`` less the umask), written, fsynced
    and renamed over the name relative to the folder's descriptor. Whatever was planted at the
    name meanwhile (a link to one of your files, a FIFO) is replaced, never opened; a reader
    sees the old file or the new one. ``OSError`` is left to the caller (a folder gone, another
    user's file in a sticky folder, a folder at the name).

    Args:
        path: the file to write, replacing whatever is there.
        data: the bytes to write.
        mode: the file's permission bits, less the umask (``0o644``).

    >>> write_output("/tmp/out.json", b"{}")   # doctest: +SKIP
    """
    import contextlib
    import secrets

    folder, name = os.path.split(os.fspath(path))
    if not name or name in (".", ".."):
        raise IsADirectoryError(getattr(os, "EISDIR", 21), "names a folder, not a file", path)
    dir_fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            temp = f".{name[:200]}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            try:
                fd = os.open(temp, flags, mode, dir_fd=dir_fd)
            except FileExistsError:  # someone's name, maybe planted: never reused
                continue
            break
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)
