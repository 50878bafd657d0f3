"""The architecture keeps its promises (docs/architecture.md, "Layers"): the layers, in order,
import only downward and never in a cycle; the CLI uses the library's public names only; each
``__all__`` names what its module defines; no package outgrows a fifth of the code; gpus/ holds
no locks or tickets; gpus/ and sharing/ never import torch."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import gpukit
from tests.helpers import run_python

SRC = Path(gpukit.__file__).resolve().parent

# Bottom to top: a part may import its own layer's parts (no cycles) and the layers below it,
# never one above. The same order, with the reason for each place, is in docs/architecture.md.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("untrusted", "output", "sizes", "holders"),
    ("gpus",),  # below devices: devices.py asks gpus/visible.py whether CUDA has started
    ("sharing",),
    ("devices", "_tree", "_agree"),
    ("transfer", "repro", "sysinfo", "supervise"),  # supervise: processes, not GPUs or torch
    ("parallel", "memory"),
    ("checkpoint",),  # above parallel: a checkpoint of a DataParallel model is unwrapped
    ("train",),
    ("distributed",),
    ("doctor", "demo", "serve"),
    ("bench",),  # above serve: `gpukit bench` measures the dashboard's server
    ("cli", "__main__"),
)
# What train/ may not import although some of it sits below (docs/architecture.md, "The
# training room"): it asks torch.distributed for the job, and is composed by distributed/.
TRAIN_NEVER_IMPORTS = ("distributed", "parallel", "serve", "bench", "cli")
# The loader, the training step, the gradient hook, the training state and the metrics are handed
# their step context (docs/architecture.md, "The training room"): none of these modules may
# hold a module-level list, dict or set through which they would find each other again.
NO_REGISTRIES = (
    "train/step.py",
    "train/state.py",
    "train/context.py",
    "train/accumulate.py",
    "distributed/data.py",
    "distributed/ddp.py",
    "distributed/metrics.py",
)
MUTABLE_CONTAINERS = frozenset(
    {"list", "dict", "set", "defaultdict", "deque", "OrderedDict", "WeakSet"}
    | {"WeakValueDictionary", "WeakKeyDictionary"}
)
# Names a module lists in __all__ without defining them, or imports though private: none
# remain, and nothing may be added here.
NOT_YET_OWN: dict[str, frozenset[str]] = {}
NOT_YET_FROM_DEFINER: dict[str, frozenset[str]] = {}
NOT_YET_PUBLIC: dict[str, frozenset[str]] = {}


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


def _part(path: Path) -> str:
    """The layer part a source file belongs to: its package, or its own name at the top."""
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def _part_imports() -> dict[str, set[tuple[str, str]]]:
    """Part -> (imported part, importing file) for every import of another gpukit part."""
    parts = {_part(p) for p in SRC.rglob("*.py")}
    found: dict[str, set[tuple[str, str]]] = {}
    for path in SRC.rglob("*.py"):
        here = _part(path)
        for name in _imports(path):
            bits = name.split(".")
            if bits[0] == "gpukit" and len(bits) > 1 and bits[1] in parts and bits[1] != here:
                found.setdefault(here, set()).add((bits[1], str(path.relative_to(SRC))))
    return found


def test_every_part_of_gpukit_has_its_place_in_the_layers() -> None:
    placed = [part for layer in LAYERS for part in layer]
    parts = {_part(p) for p in SRC.rglob("*.py")} - {"__init__"}
    assert sorted(parts - set(placed)) == []
    assert len(placed) == len(set(placed))


def test_nothing_imports_a_layer_above_its_own() -> None:
    # The package's __init__ is the lazy face over all of them, and imports only errors.
    level = {part: i for i, layer in enumerate(LAYERS) for part in layer}
    upward = sorted(
        f"{where} imports gpukit.{target} ({part} is below {target})"
        for part, targets in _part_imports().items()
        if part != "__init__"
        for target, where in targets
        if level[target] > level[part]
    )
    assert upward == []


def test_the_package_face_imports_only_errors_at_import_time() -> None:
    tree = ast.parse((SRC / "__init__.py").read_text())
    eager = [
        node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpukit")
    ]
    assert eager == ["gpukit.errors"]


def test_train_imports_none_of_the_parts_it_is_composed_by() -> None:
    bad = sorted(
        f"{where} imports gpukit.{target}"
        for target, where in _part_imports().get("train", set())
        if target in TRAIN_NEVER_IMPORTS
    )
    assert bad == []


def _is_mutable_container(value: ast.expr) -> bool:
    """Whether an expression makes a list, dict or set (a literal, a comprehension, a call)."""
    literals = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
    if isinstance(value, literals):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        return name in MUTABLE_CONTAINERS
    return False


def _module_level_containers(path: Path) -> list[str]:
    """Each name a module binds, at its top level, to a new list, dict or set (``__all__``,
    which Python's import machinery reads, aside)."""
    found = []
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if _is_mutable_container(value):
            names = [t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
            found += [f"{name} (line {node.lineno})" for name in names]
    return found


@pytest.mark.parametrize("name", NO_REGISTRIES)
def test_the_loader_the_step_the_hook_and_the_state_share_no_module_level_registry(
    name: str,
) -> None:
    # A registry (`_FEEDING: list[TrainStep] = []`) joined them behind the user's back, shared
    # by every thread; they are handed one StepContext instead, and the one lookup left is a
    # ContextVar (train/context.py).
    assert _module_level_containers(SRC / name) == []


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


# The collectives through which ranks agree on an answer (rather than compute a sum or gather
# data): only gpukit/_agree.py calls them.
AGREEING = frozenset(
    {"broadcast", "broadcast_object_list", "all_gather_object", "gather_object"}
    | {"scatter_object_list"}
)


def _agreements(path: Path) -> list[str]:
    """Where ``path`` makes ranks agree by hand: an agreeing collective of torch.distributed,
    or an all_reduce with MIN or MAX."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if ast.unparse(node.func.value) not in ("dist", "torch.distributed"):
            continue
        name = node.func.attr
        ops = [ast.unparse(k.value) for k in node.keywords if k.arg == "op"]
        if name in AGREEING or (
            name == "all_reduce" and any(o.endswith(("MIN", "MAX")) for o in ops)
        ):
            found.append(f"{path.relative_to(SRC)}:{node.lineno} {name}")
    return found


def test_ranks_agree_through_one_helper() -> None:
    by_hand = [
        where
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "_agree.py"
        for where in _agreements(path)
    ]
    assert by_hand == []


def test_one_module_writes_dcp_checkpoints() -> None:
    writers = sorted(
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        for name in _imports(path)
        if name.endswith(".FileSystemWriter")
        or name.startswith("torch.distributed.checkpoint.state_dict_saver")
    )
    assert set(writers) == {"checkpoint/dcp.py"}


def test_a_script_that_prepares_and_steps_loads_no_save_and_no_checkpoint_code() -> None:
    out = run_python(
        "import sys\n"
        "from gpukit.distributed import prepare, step\n"
        "from gpukit.train import TrainStep\n"
        "print(sorted(m for m in sys.modules if m.startswith('gpukit.')))"
    )
    loaded = set(ast.literal_eval(out.strip()))
    heavy = sorted(
        name
        for name in loaded
        if (name.startswith("gpukit.checkpoint.") and name != "gpukit.checkpoint.dtensor")
        or name in ("gpukit.train.state", "gpukit.train.saves", "gpukit.train.preempt")
    )
    assert heavy == []


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


@pytest.mark.parametrize("path", sorted((SRC / "cli").glob("*.py")), ids=lambda p: p.name)
def test_cli_imports_only_public_names_of_the_library(path: Path) -> None:
    # Public: no leading underscore, and listed in the module's __all__ where it has one.
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("gpukit."):
            continue
        if node.module.startswith("gpukit.cli"):
            continue
        listed = getattr(importlib.import_module(node.module), "__all__", None)
        for alias in node.names:
            module_path = SRC.parent / (node.module.replace(".", "/") + f"/{alias.name}.py")
            if module_path.exists():
                continue  # a public module, checked by the test above
            if alias.name.startswith("_") or (listed is not None and alias.name not in listed):
                bad.append(f"{node.module}.{alias.name}")
    bad = [name for name in bad if name not in NOT_YET_PUBLIC.get(path.name, frozenset())]
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


def _defined(tree: ast.Module) -> set[str]:
    """The names a module's own top-level statements bind (imports excluded)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _listed(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                return None  # built from the lazy table: checked by the test below
    return None


@pytest.mark.parametrize(
    "path",
    [p for p in sorted(SRC.rglob("*.py")) if p.name != "__init__.py"],
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_a_modules_all_lists_only_names_it_defines(path: Path) -> None:
    tree = ast.parse(path.read_text())
    listed = _listed(tree) or []
    foreign = set(listed) - _defined(tree) - NOT_YET_OWN.get(_module_name(path), frozenset())
    assert sorted(foreign) == [], f"{path.relative_to(SRC)} lists names it imports"


@pytest.mark.parametrize("path", sorted(SRC.rglob("__init__.py")), ids=lambda p: p.parent.name)
def test_a_package_exports_each_name_from_the_module_that_defines_it(path: Path) -> None:
    package = _module_name(path)
    tree = ast.parse(path.read_text())
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpukit."):
            source = SRC.parent / node.module.replace(".", "/")
            file = source / "__init__.py" if source.is_dir() else source.with_suffix(".py")
            defined = _defined(ast.parse(file.read_text()))
            wrong += [
                f"{a.name} from {node.module}"
                for a in node.names
                if a.name not in defined
                and not (source / f"{a.name}.py").exists()
                and a.name not in NOT_YET_FROM_DEFINER.get(package, frozenset())
            ]
    lazy = getattr(importlib.import_module(package), "_EXPORTS", {})
    for name, module in lazy.items():
        file = SRC.parent / (module.replace(".", "/") + ".py")
        if not file.exists() or name not in _defined(ast.parse(file.read_text())):
            wrong.append(f"{name} from {module} (_EXPORTS)")
    assert wrong == [], f"{package} exports {wrong}"


def test_no_package_holds_more_than_a_fifth_of_the_source_lines() -> None:
    lines: dict[str, int] = {}
    for path in SRC.rglob("*.py"):
        relative = path.relative_to(SRC).parts
        if len(relative) > 1:
            lines[relative[0]] = lines.get(relative[0], 0) + len(path.read_text().splitlines())
    total = sum(len(p.read_text().splitlines()) for p in SRC.rglob("*.py"))
    big = {name: f"{count / total:.0%}" for name, count in lines.items() if count * 5 > total}
    assert big == {}


def test_gpus_holds_no_locks_no_tickets_and_no_claims() -> None:
    # The machine's GPUs as NVML sees them; how processes share them is sharing/'s.
    words = ("lock", "ticket", "claim", "queue", "waiter", "ledger", "polic")
    named = [p.name for p in (SRC / "gpus").rglob("*.py") if any(w in p.stem for w in words)]
    imports = sorted(
        f"{path.name}: {name}"
        for path in (SRC / "gpus").rglob("*.py")
        for name in _imports(path)
        if name.startswith("gpukit.sharing") or name in ("fcntl", "gpukit.holders.UNREADABLE")
    )
    assert (named, imports) == ([], [])


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
