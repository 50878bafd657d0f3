"""Every public callable of gpukit says what its arguments are: an ``Args:`` section naming each.

Public: a name in ``__all__`` of ``gpukit`` or of one of its packages, and the public methods
of such a class. Left out: exceptions, enums and dataclasses (records whose fields document
themselves), methods that override a documented method of a base class outside gpukit (a
``socketserver`` hook, ``nn.Module.forward``), and callables that take no argument.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import gpukit

FACES = [
    "gpukit",
    *sorted(f"gpukit.{m.name}" for m in pkgutil.iter_modules(gpukit.__path__) if m.ispkg),
]


def _is_record(obj: type) -> bool:
    return (
        issubclass(obj, (BaseException, enum.Enum))
        or dataclasses.is_dataclass(obj)
        or (issubclass(obj, tuple) and hasattr(obj, "_fields"))
    )


def _overrides_a_foreign_method(cls: type, name: str) -> bool:
    return any(
        name in vars(base) and not base.__module__.startswith("gpukit") for base in cls.__mro__[1:]
    )


def _public_callables() -> Iterator[tuple[str, Callable[..., Any], str]]:
    """(label, callable whose parameters count, its docstring) for each public callable."""
    seen: set[int] = set()
    for face in FACES:
        module = importlib.import_module(face)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if id(obj) in seen or not callable(obj):
                continue
            seen.add(id(obj))
            label = f"{face}.{name}"
            if not inspect.isclass(obj):
                yield label, obj, inspect.getdoc(obj) or ""
                continue
            if _is_record(obj):
                continue
            init = obj.__init__ if "__init__" in vars(obj) else None
            doc = (inspect.getdoc(obj) or "") + "\n" + ((init and inspect.getdoc(init)) or "")
            if init is not None:
                yield label, init, doc
            for attr, member in vars(obj).items():
                if attr.startswith("_") or _overrides_a_foreign_method(obj, attr):
                    continue
                function = getattr(member, "__func__", member)
                if inspect.isfunction(function):
                    yield f"{label}.{attr}", function, inspect.getdoc(function) or ""


def _parameters(fn: Callable[..., Any]) -> list[str]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    names = []
    for parameter in signature.parameters.values():
        if parameter.name in ("self", "cls"):
            continue
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
        names.append(prefix.get(parameter.kind, "") + parameter.name)
    return names


def _undocumented(doc: str, names: list[str]) -> list[str]:
    """The parameter names the docstring's Args: section does not name."""
    section = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)+)", doc, re.MULTILINE)
    if section is None:
        return names
    listed = set(re.findall(r"^[ \t]+(\*{0,2}\w+)(?: \([^)]*\))?:", section.group(1), re.MULTILINE))
    return [name for name in names if name not in listed and name.lstrip("*") not in listed]


CALLABLES = sorted((label, fn, doc) for label, fn, doc in _public_callables() if _parameters(fn))


@pytest.mark.parametrize(("label", "fn", "doc"), CALLABLES, ids=[c[0] for c in CALLABLES])
def test_every_argument_of_a_public_callable_is_documented(
    label: str, fn: Callable[..., Any], doc: str
) -> None:
    assert _undocumented(doc, _parameters(fn)) == [], f"{label}: Args: section"
