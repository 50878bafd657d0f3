"""Sizes in bytes: the one reader (:func:`parse_size`) and the one writer (:func:`format_size`).

Every size gpukit takes goes through :func:`parse_size`: ``gk.pick(min_free=...)``,
``gk.save(max_shard_size=...)`` and the command line's ``--min-free`` and ``--max-shard-size``.
The grammar: a number (``2``, ``1.5``, ``.5``, any number of digits, read exactly), optional
spaces, and an optional unit, in any case:

* ``B`` is bytes; a number without a unit is bytes too.
* ``KB``, ``MB``, ``GB``, ``TB`` are powers of 1000 (``"5GB"`` is 5 * 10**9 bytes, as Hugging
  Face's ``max_shard_size`` counts).
* ``KiB``, ``MiB``, ``GiB``, ``TiB`` and the bare ``K``, ``M``, ``G``, ``T`` are powers of 1024
  (``"2G"`` is 2 * 2**30 bytes, as nvidia-smi's MiB and ``ls -h`` count).

A fraction of a byte is dropped (``"1.5KiB"`` is 1536, ``"0.5B"`` is 0). Negative sizes,
``nan``, ``inf`` and ``True`` are refused as :class:`~gpukit.errors.InvalidArgumentError`.

>>> parse_size("2G"), parse_size("1.5GB"), parse_size(".5GiB"), parse_size(4096)
(2147483648, 1500000000, 536870912, 4096)
>>> format_size(3 * 2**29)
'1.5 GiB'

Never imports torch.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping
from fractions import Fraction
from types import MappingProxyType

from gpukit.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "MOST_SIZE",
    "SIZE_UNITS",
    "format_size",
    "parse_shard_size",
    "parse_size",
]

SIZE_UNITS: Mapping[str, int] = MappingProxyType(
    {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "k": 2**10,
        "kib": 2**10,
        "m": 2**20,
        "mib": 2**20,
        "g": 2**30,
        "gib": 2**30,
        "t": 2**40,
        "tib": 2**40,
    }
)
"""Bytes in each unit :func:`parse_size` reads, by its lower-case spelling (``""``: bytes)."""

MOST_SIZE = 2**100
"""The largest size :func:`parse_size` reads unless told otherwise: far past any GPU."""

DEFAULT_SHARD_SIZE = "5GB"
"""The largest shard of a sharded checkpoint folder when none is given (Hugging Face's default),
for ``gk.save`` and ``gpukit ckpt convert`` alike."""

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$", re.ASCII)
_HINT = 'Write a number of bytes or a size with a unit, e.g. "8GiB", "500MB".'
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def parse_size(
    value: int | float | str,
    *,
    minimum: int = 0,
    most: int | None = MOST_SIZE,
    warn_unitless_below: int = 0,
) -> int:
    """Bytes from a number of bytes or a size such as ``"8GiB"``, ``"500MB"``, ``"1.5G"``.

    The grammar is the module's (``GB`` is 10**9 bytes, ``G`` and ``GiB`` 2**30). Sizes under
    ``minimum`` bytes, or over ``most`` (``None``: no bound), are refused. A number without a
    unit (``20``, ``"20"``) is bytes; when it is from 1 byte to under ``warn_unitless_below``,
    a ``UserWarning`` says so (``min_free=20`` is most likely meant as ``"20GiB"``).

    >>> parse_size("8GiB"), parse_size("500MB"), parse_size(2**20), parse_size("20B")
    (8589934592, 500000000, 1048576, 20)

    Args:
        value: bytes (an int or a float, cut to whole bytes), or a string with an optional unit.
        minimum: the fewest bytes accepted (0).
        most: the most bytes accepted (:data:`MOST_SIZE`, 2**100); None: no bound.
        warn_unitless_below: a unitless size from 1 byte to under this warns (0: never).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidArgumentError(f"{_shown(value)} is not a memory size.", hint=_HINT)
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{value!r} is not a memory size.", hint=_HINT)
        number, unit = Fraction(value), ""
    else:
        match = _SIZE.match(value)
        if match is None or match.group(2).lower() not in SIZE_UNITS:
            raise InvalidArgumentError(f"Cannot read {_shown(value)} as a memory size.", hint=_HINT)
        # Exact, not float: 400 digits are a (very large) number, not infinity.
        number, unit = Fraction(match.group(1)), match.group(2).lower()
    if number < 0:
        raise InvalidArgumentError(f"A memory size cannot be negative ({value!r}).", hint=_HINT)
    size = int(number * SIZE_UNITS[unit])
    if most is not None and size > most:
        raise InvalidArgumentError(
            f"{_shown(value)} is more memory than any GPU has (gpukit refuses sizes past "
            + ("2**100 bytes)." if most == MOST_SIZE else f"{format_size(most)})."),
            hint='Write a size a GPU can have, e.g. "80GiB".',
        )
    if size < minimum:
        raise InvalidArgumentError(
            f"A size of {_shown(value)} is less than {format_size(minimum)}.",
            hint=f'Write a size of at least {format_size(minimum)}, e.g. "2GB" or "500MiB".',
        )
    if unit == "" and 0 < size < warn_unitless_below:
        warnings.warn(
            f"A size of {value!r} without a unit is read as {format_size(size)}; write "
            f"'{value}GiB' if you meant gibibytes, or '{value}B' to say bytes.",
            stacklevel=3,
        )
    return size


def parse_shard_size(value: object, *, option: str | None = "max_shard_size") -> int:
    """Bytes from a ``max_shard_size``: a whole number of bytes (``4096``) or a size in this
    module's grammar (``"2GB"`` is 2 * 10**9 bytes, as Hugging Face counts; ``"2G"`` and
    ``"2GiB"`` 2 * 2**30; ``"1.5G"``, ``".5GB"``). At least one byte, and no bound above; a
    float is refused. ``option`` is the name messages begin with (``None``: none).

    >>> parse_shard_size("500MiB"), parse_shard_size("2G"), parse_shard_size(".5GB")
    (524288000, 2147483648, 500000000)

    Args:
        value: an int of bytes or a size string; anything else is refused.
        option: the option's name that messages begin with (``"max_shard_size"``); None: none.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgumentError(
            f"{option or 'A shard size'} must be a number of bytes or a size such as '2GB', "
            f"not {_shown(value)}.",
            hint=_SHARD_HINT,
        )
    try:
        return parse_size(value, minimum=1, most=None)
    except InvalidArgumentError as exc:
        said = exc.message if option is None else f"{option}: {exc.message}"
        raise InvalidArgumentError(said, hint=_SHARD_HINT) from None


_SHARD_HINT = "Use bytes or a size such as '2GB', '1.5G', '500MB' or '512MiB'."


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} characters)"


def format_size(n: float) -> str:
    """A number of bytes in the largest binary unit it fills: whole when it is a whole number
    of that unit, else to one decimal. The one way gpukit writes sizes.

    >>> format_size(512), format_size(20 * 2**10), format_size(3 * 2**29), format_size(2**36)
    ('512 B', '20 KiB', '1.5 GiB', '64 GiB')

    Args:
        n: a number of bytes; fractions and negative numbers are written too.
    """
    value = float(n)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for power, unit in enumerate(_BINARY):
        scaled = value / 1024**power
        if abs(scaled) < 1023.95 or unit == _BINARY[-1]:
            whole = float(n).is_integer() and int(n) % 1024**power == 0
            return f"{int(n) // 1024**power} {unit}" if whole else f"{scaled:.1f} {unit}"
    raise AssertionError("unreachable")
