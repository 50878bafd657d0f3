"""The source itself: no reader of data parses it with anything but the untrusted layer.

A parser called anywhere else (``json.loads``, ``tomllib.loads``, ``pickle.loads``...) is
either reading gpukit's own data, said here with the reason, or a reader that skipped the
layer's bounds: this test names it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gpukit

SRC = Path(gpukit.__file__).resolve().parent
PARSERS = {
    ("json", "loads"),
    ("json", "load"),
    ("tomllib", "loads"),
    ("tomllib", "load"),
    ("pickle", "loads"),
    ("pickle", "load"),
}
# module -> why its parser call reads nothing another user, host or stranger controls.
OWN_DATA = {
    "distributed/launcher.py": "the note a worker of this launch wrote in its private folder",
    "checkpoint/api.py": "a round trip of metadata the caller passed to gk.save",
    "sharing/claims.py": (
        "the holder record this process has just written, read back for the ledger"
    ),
}


def _parser_calls(path: Path) -> list[str]:
    calls = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and (node.func.value.id, node.func.attr) in PARSERS
        ):
            calls.append(f"{node.func.value.id}.{node.func.attr} (line {node.lineno})")
    return calls


def test_only_the_layer_parses_what_others_wrote() -> None:
    found = {
        path.relative_to(SRC).as_posix(): _parser_calls(path)
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "untrusted.py"
    }
    outside = {module: calls for module, calls in found.items() if calls and module not in OWN_DATA}
    assert outside == {}, (
        "parse others' data with gpukit.untrusted (parse_json, parse_toml), or add the module "
        "to OWN_DATA with the reason its data is gpukit's own"
    )


def test_every_exception_said_here_still_has_its_parser() -> None:
    """An entry of OWN_DATA whose parser is gone is a stale exception: remove it."""
    for module in OWN_DATA:
        assert _parser_calls(SRC / module), module
