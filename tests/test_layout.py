"""The package layout keeps its promises: what each folder may import, and the public names."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import gpukit

from .conftest import run_python

SRC = Path(gpukit.__file__).resolve().parent


def _imports(path: Path) -> list[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize(
    "path",
    sorted([*(SRC / "gpus").rglob("*.py"), *(SRC / "sharing").rglob("*.py"), SRC / "holders.py"]),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_gpus_and_sharing_never_import_torch(path: Path) -> None:
    torch_imports = [n for n in _imports(path) if n == "torch" or n.startswith("torch.")]
    assert torch_imports == [], f"{path.name} imports {torch_imports}"


def test_importing_every_gpus_and_sharing_module_leaves_torch_unloaded() -> None:
    names = [
        f"gpukit.{folder}.{p.stem}"
        for folder in ("gpus", "sharing")
        for p in sorted((SRC / folder).glob("*.py"))
    ]
    out = run_python(
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print('torch' in sys.modules)"
    )
    assert out.strip() == "False"


@pytest.mark.parametrize("path", sorted((SRC / "cli").glob("*.py")), ids=lambda p: p.name)
def test_cli_uses_no_private_module_and_no_other_command(path: Path) -> None:
    commands = {p.stem for p in (SRC / "cli").glob("*.py") if not p.stem.startswith("_")}
    bad = []
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] != "gpukit":
            continue
        if parts[:2] == ["gpukit", "cli"]:
            if len(parts) > 2 and parts[2] in commands and parts[2] != path.stem:
                bad.append(name)
        elif _is_private(name):
            bad.append(name)
    assert bad == [], f"cli/{path.name} imports {bad}"


def _is_private(name: str) -> bool:
    """``gpukit._x``, ``gpukit.pkg._x`` or anything inside them (names imported from a module
    that is public are fine, whatever they are called)."""
    parts = name.split(".")
    modules = _module_names()
    return any(
        part.startswith("_") and not part.startswith("__") and ".".join(parts[: i + 1]) in modules
        for i, part in enumerate(parts)
    )


def _module_names() -> set[str]:
    return {
        "gpukit." + ".".join(p.relative_to(SRC).with_suffix("").parts) for p in SRC.rglob("*.py")
    }


def test_every_public_name_imports() -> None:
    for name in gpukit.__all__:
        assert getattr(gpukit, name) is not None, name


def test_gk_inventory_is_the_function_even_after_importing_its_module() -> None:
    importlib.import_module("gpukit.gpus.inventory")
    assert callable(gpukit.inventory)
    assert gpukit.inventory.__module__ == "gpukit.gpus.inventory"


def test_no_import_cycles_between_library_modules() -> None:
    graph: dict[str, set[str]] = {}
    modules = _module_names()
    for path in SRC.rglob("*.py"):
        name = "gpukit." + ".".join(path.relative_to(SRC).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        targets = set()
        for imported in _imports(path):
            while imported and imported not in modules and f"{imported}.__init__" not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and imported != "gpukit":
                targets.add(imported.removesuffix(".__init__"))
        graph[name] = targets

    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                raise AssertionError(
                    "import cycle: " + " -> ".join([*stack[stack.index(nxt) :], nxt])
                )
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_architecture_map_names_every_module() -> None:
    architecture = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    unnamed = [
        str(path.relative_to(SRC))
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "__init__.py" and path.name not in architecture
    ]
    assert unnamed == [], f"docs/architecture.md does not name {unnamed}"


def test_no_public_name_is_shadowed_by_a_module_of_the_same_name() -> None:
    # Importing gpukit.pkg.x sets the package's attribute x to the module: a lazily exported
    # function x of that package would then be replaced by it (gk.distributed.prepare(...)
    # would raise "'module' object is not callable"). Import everything, then look.
    code = (
        "import importlib, pkgutil, types, gpukit\n"
        "names = [i.name for i in pkgutil.walk_packages(gpukit.__path__, 'gpukit.')]\n"
        "names = [n for n in names if n != 'gpukit.__main__']\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "bad = []\n"
        "for name in ['gpukit', *names]:\n"
        "    package = importlib.import_module(name)\n"
        "    submodules = getattr(package, '_SUBMODULES', ())\n"
        "    for public in getattr(package, '__all__', ()):\n"
        "        value = getattr(package, public)\n"
        "        if isinstance(value, types.ModuleType) and public not in submodules:\n"
        "            bad.append(f'{name}.{public}')\n"
        "print(bad)"
    )
    assert run_python(code).strip() == "[]"
