"""Slurm's compact host lists, expanded exactly as ``scontrol show hostnames`` does.

``gpu[07-08,10],login1`` is ``gpu07 gpu08 gpu10 login1``: ranges keep their zero padding,
several bracket groups in one name multiply out, a suffix may follow the brackets, and commas
outside brackets separate names.
"""

from __future__ import annotations

import re

from gpukit.errors import DistributedError

__all__ = ["expand_hostlist"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_MAX_HOSTS = 1 << 20  # a typo such as n[1-999999999] must not eat the memory of every rank


def _bad_hostlist(text: str, why: str) -> DistributedError:
    return DistributedError(
        f"Cannot read the Slurm host list {text!r}: {why}.",
        hint="Check SLURM_JOB_NODELIST (`scontrol show hostnames` should accept it), or set "
        "MASTER_ADDR to the first node's address.",
    )


def _bracket(body: str, text: str) -> list[str]:
    """``"1-3,07"`` -> ``["1", "2", "3", "07"]``; each range keeps the width of its start."""
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part)
        if match is None:
            raise _bad_hostlist(text, f"[{body}] holds {part!r}, not a number or range")
        lo_text, hi_text = match.group(1), match.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise _bad_hostlist(text, f"the range {part} runs backwards")
        if len(numbers) + hi - lo + 1 > _MAX_HOSTS:
            raise _bad_hostlist(text, f"it names more than {_MAX_HOSTS} hosts")
        # As Slurm: the width is that of the range's first number, so 08-12 is 08..12, 8-12 is
        # 8..12, and a number wider than the width is printed whole.
        width = len(lo_text)
        numbers.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return numbers


def _expand_one(expr: str, text: str) -> list[str]:
    """One host expression, e.g. ``"rack[1-2]-node[01-02]"``; brackets multiply, first outermost."""
    hosts = [""]
    rest = expr
    while rest:
        start = rest.find("[")
        if start < 0:
            if "]" in rest:
                raise _bad_hostlist(text, "a ']' closes no '['")
            hosts = [h + rest for h in hosts]
            break
        end = rest.find("]", start)
        if end < 0 or "[" in rest[start + 1 : end]:
            raise _bad_hostlist(text, "a '[' is never closed")
        prefix = rest[:start]
        if "]" in prefix:
            raise _bad_hostlist(text, "a ']' closes no '['")
        numbers = _bracket(rest[start + 1 : end], text)
        if len(hosts) * len(numbers) > _MAX_HOSTS:
            raise _bad_hostlist(text, f"it names more than {_MAX_HOSTS} hosts")
        hosts = [h + prefix + n for h in hosts for n in numbers]
        rest = rest[end + 1 :]
    return hosts


def expand_hostlist(text: str) -> list[str]:
    """The hosts of a Slurm host list, in order, as ``scontrol show hostnames`` prints them.

    Ranges (``n[1-3]``), zero padding (``n[08-10]``), comma lists inside and outside brackets,
    several bracket groups (the first varies slowest) and text after a bracket are expanded.

    >>> expand_hostlist("gpu[08-10],login1")
    ['gpu08', 'gpu09', 'gpu10', 'login1']
    >>> expand_hostlist("r[1-2]n[1-2]-ib")
    ['r1n1-ib', 'r1n2-ib', 'r2n1-ib', 'r2n2-ib']
    """
    hosts: list[str] = []
    depth = 0
    current = ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth == 0 and (ch == "," or ch.isspace()):
            if current:
                hosts += _expand_one(current, text)
            current = ""
            continue
        current += ch
    if depth != 0:
        raise _bad_hostlist(text, "its brackets do not pair up")
    if current:
        hosts += _expand_one(current, text)
    return hosts
