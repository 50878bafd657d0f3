"""A sharded model reaches the disk one way: one DCP writer, one is_sharded, one folder fsync.

Two copies of each had grown apart (gk.save's DCP folders were written without the agreement
and the typed errors of the training state's, and ``w.PT`` meant a file to one and a folder to
the other); these tests keep each in its one home, in the checkpoint layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpukit

SRC = Path(gpukit.__file__).resolve().parent


def _sources() -> list[tuple[str, ast.Module]]:
    return [
        (str(p.relative_to(SRC)), ast.parse(p.read_text(), filename=str(p)))
        for p in sorted(SRC.rglob("*.py"))
    ]


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _names(node: ast.AST) -> set[str]:
    """Every name and attribute written in ``node`` (``os.fsync`` gives ``os`` and ``fsync``)."""
    found: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            found.add(child.id)
        elif isinstance(child, ast.Attribute):
            found.add(child.attr)
        elif isinstance(child, ast.ImportFrom):
            found.add(child.module or "")
            found.update(alias.name for alias in child.names)
    return found


def test_only_the_checkpoint_layers_dcp_module_writes_dcp_folders() -> None:
    # torch's DCP saver and its file writer, wherever they are imported (functions included).
    writers = {"torch.distributed.checkpoint.state_dict_saver", "FileSystemWriter", "async_save"}
    found = sorted(path for path, tree in _sources() if _names(tree) & writers)
    assert found == ["checkpoint/dcp.py"]


def test_whether_a_model_is_sharded_is_decided_in_one_place() -> None:
    defined = sorted(
        f"{path}:{f.name}"
        for path, tree in _sources()
        for f in _functions(tree)
        if f.name.lstrip("_").startswith("is_sharded")
    )
    assert defined == ["checkpoint/dtensor.py:is_sharded"]


def _fsyncs_a_descriptor(function: ast.AST) -> bool:
    """Whether ``function`` calls ``fsync(fd)`` on a bare descriptor (not ``handle.fileno()``)."""
    return any(
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute | ast.Name)
        and (call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id) == "fsync"
        and len(call.args) == 1
        and isinstance(call.args[0], ast.Name)
        for call in ast.walk(function)
    )


def test_folders_are_fsynced_by_one_function_of_the_checkpoint_layer() -> None:
    # A folder is fsynced through a descriptor opened read-only; a file through its handle.
    fsyncing = sorted(
        f"{path}:{f.name}"
        for path, tree in _sources()
        for f in _functions(tree)
        if "O_RDONLY" in _names(f) and _fsyncs_a_descriptor(f)
    )
    assert fsyncing == ["checkpoint/atomic.py:fsync_folder"]


def test_the_training_state_fsyncs_its_folders_through_that_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpukit.checkpoint import atomic
    from gpukit.train import saves

    calls: list[Path] = []
    monkeypatch.setattr(atomic, "fsync_folder", calls.append)
    saves.fsync_folder(SRC)
    assert calls == [SRC]
