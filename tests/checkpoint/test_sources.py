"""Every kind of checkpoint behind the one Source interface: stored keys, one read of the index.

A source names each tensor by the key it stores it under; the load plan carries that key, and
``read_into`` fills the targets given for it. These tests hold each kind to that contract, count
the opens of a sharded folder's index, and show that a new layout is one more source.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

import gpukit as gk
from gpukit import untrusted
from gpukit.checkpoint import layout
from gpukit.checkpoint.layout import open_source
from gpukit.checkpoint.plan import plan_load, weights_in
from gpukit.checkpoint.source import Location, Source, shape_only

SRC = Path(gk.__file__).resolve().parent


def _model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))


def _file(folder: Path, model: nn.Module) -> Path:
    path = folder / "last.pt"
    torch.save({"model": nn.DataParallel(model).state_dict(), "epoch": 4}, path)
    return path


def _sharded(folder: Path, model: nn.Module) -> Path:
    return gk.save(model, folder / "weights", max_shard_size=64)


def _dcp(folder: Path, model: nn.Module) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict()}, checkpoint_id=folder / "dcp", no_dist=True)
    return folder / "dcp"


def _accelerate(folder: Path, model: nn.Module) -> Path:
    state = folder / "state"
    state.mkdir()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, state / "model.safetensors"
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.save(optimizer.state_dict(), state / "optimizer.bin")
    torch.save({"step": 1}, state / "random_states_0.pkl")
    return state


KINDS: dict[str, Callable[[Path, nn.Module], Path]] = {
    "file": _file,
    "sharded": _sharded,
    "dcp": _dcp,
    "accelerate": _accelerate,
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_fills_the_targets_named_by_the_stored_keys_the_plan_carries(
    kind: str, tmp_path: Path
) -> None:
    model = _model()
    source = open_source(KINDS[kind](tmp_path, model), target=torch.device("cpu"), trust=False)
    assert source.layout == kind
    found = weights_in(source)
    fresh = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    state = fresh.state_dict()
    with torch.no_grad():
        for tensor in state.values():
            tensor.zero_()
    plan = plan_load(
        found.state, state, None, lambda key: source.stored_key((*found.location, key))
    )
    assert sorted(plan.stored) == sorted(state)
    source.read_into(plan.targets(state), trust=False)
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name


def test_a_dcp_folders_plan_carries_dcps_own_flattened_names(tmp_path: Path) -> None:
    source = open_source(_dcp(tmp_path, _model()), target=None, trust=False)
    found = weights_in(source)
    plan = plan_load(
        found.state, _model().state_dict(), None, lambda k: source.stored_key((*found.location, k))
    )
    assert plan.stored["0.weight"] == "model.0.weight"
    assert plan.stored["2.bias"] == "model.2.bias"


@pytest.mark.parametrize("given", ["folder", "index"])
def test_loading_a_sharded_folder_opens_its_index_once(
    given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _sharded(tmp_path, model := _model())
    index = folder / "model.safetensors.index.json"
    opened: list[str] = []
    real = untrusted.open_regular

    def counting(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(untrusted, "open_regular", counting)
    fresh = _model()
    with torch.no_grad():
        fresh[0].weight.zero_()
    gk.load(fresh, folder if given == "folder" else index)
    assert opened.count(index.name) == 1, opened
    assert torch.equal(fresh[0].weight, model[0].weight)


def _source_classes() -> set[str]:
    """The classes of gpukit.checkpoint that read tensors into targets by stored key."""
    names = set()
    for path in (SRC / "checkpoint").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                if {"read_into", "stored_key"} <= methods:
                    names.add(node.name)
    return names


def test_no_code_asks_which_kind_of_source_it_holds() -> None:
    sources = _source_classes()
    assert {"SingleFile", "ShardedFolder", "DcpFolder", "AccelerateState"} <= sources
    asked = []
    for path in [*(SRC / "checkpoint").glob("*.py"), SRC / "cli" / "ckpt.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
            ):
                kinds = node.args[1]
                named = [kinds] if not isinstance(kinds, ast.Tuple) else list(kinds.elts)
                asked += [
                    f"{path.name}:{node.lineno}"
                    for n in named
                    if isinstance(n, ast.Name) and n.id in sources
                ]
    assert asked == []


# -- a new layout is one more source ---------------------------------------------------------


@dataclass
class _OneFilePerTensor:
    """A toy layout: each tensor in its own torch.save file, named by its key."""

    path: Path
    content: dict[str, torch.Tensor] = field(default_factory=dict)
    format: str = "one file per tensor"
    layout: str = "per-tensor"
    index: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    source_devices: list[str] = field(default_factory=list)

    @property
    def files(self) -> dict[str, int]:
        return {p.name: p.stat().st_size for p in sorted(self.path.glob("*.tensor"))}

    @property
    def size(self) -> int:
        return sum(self.files.values())

    def saved_device(self, tensor: torch.Tensor) -> str | None:
        return None

    def stored_key(self, location: Location) -> str:
        return f"{location[-1]}.tensor"

    def read_into(self, targets: Mapping[str, list[torch.Tensor]], *, trust: bool) -> None:
        with torch.no_grad():
            for name, tensors in targets.items():
                value = torch.load(self.path / name, weights_only=True)
                for tensor in tensors:
                    tensor.copy_(value)

    def read_extras(
        self, names: Collection[str], *, trust: bool
    ) -> tuple[dict[str, Any], dict[str, str]]:
        return {}, {}

    def read_content(self, *, trust: bool, only: Collection[str] | None = None) -> Any:
        return {k: torch.load(self.path / f"{k}.tensor") for k in self.content}


def _per_tensor(
    folder: Path, names: list[str], target: torch.device | None, trust: bool
) -> Source | None:
    if not names or not all(name.endswith(".tensor") for name in names):
        return None
    found = _OneFilePerTensor(folder)
    for name in names:
        value = torch.load(folder / name, weights_only=True)
        found.content[name.removesuffix(".tensor")] = shape_only(list(value.shape), value.dtype)
    return found


def test_a_new_kind_of_folder_loads_once_it_is_one_more_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    folder = tmp_path / "per-tensor"
    folder.mkdir()
    for key, value in model.state_dict().items():
        torch.save(value, folder / f"{key}.tensor")
    kinds = layout._FOLDER_KINDS  # the single file comes last: a folder of several is refused
    monkeypatch.setattr(layout, "_FOLDER_KINDS", (*kinds[:-1], _per_tensor, kinds[-1]))
    fresh = _model()
    with torch.no_grad():
        fresh[2].bias.zero_()
    report = gk.load(fresh, folder)
    assert report.ok
    assert report.format == "one file per tensor"
    assert torch.equal(fresh[2].bias, model[2].bias)


def test_a_named_index_that_links_out_of_its_folder_is_refused(
    tmp_path: Path,
) -> None:
    real = _sharded(tmp_path, _model())
    (elsewhere := tmp_path / "elsewhere").mkdir()
    index = elsewhere / "model.safetensors.index.json"
    index.symlink_to(real / "model.safetensors.index.json")
    with pytest.raises(gk.errors.CheckpointError, match="outside the checkpoint folder"):
        gk.load(_model(), index)


@pytest.mark.parametrize("where", ["whole", "under a key"])
def test_a_pickled_module_is_read_through_its_state_dict_with_trust(
    where: str, tmp_path: Path
) -> None:
    model = _model()
    torch.save(model if where == "whole" else {"model": model, "epoch": 2}, tmp_path / "m.pt")
    fresh = _model()
    with torch.no_grad():
        fresh[0].bias.zero_()
    report = gk.load(fresh, tmp_path / "m.pt", trust=True)
    assert report.ok
    assert torch.equal(fresh[0].bias, model[0].bias)


def test_weights_under_a_key_that_is_not_a_string_are_read_from_that_key(tmp_path: Path) -> None:
    model = _model()
    torch.save({0: model.state_dict(), "epoch": 3}, tmp_path / "m.pt")
    fresh = _model()
    with torch.no_grad():
        fresh[2].weight.zero_()
    assert gk.load(fresh, tmp_path / "m.pt").container_key == "0"
    assert torch.equal(fresh[2].weight, model[2].weight)
