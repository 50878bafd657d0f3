"""gk.load: any wrapper's keys into the plain model, from any device, without running code."""

from __future__ import annotations

import builtins
import contextlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.errors import CheckpointError, InvalidArgumentError, UntrustedCheckpointError


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    # On CPU: with one GPU, nn.DataParallel moves the model it wraps onto it.
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


@contextlib.contextmanager
def _saved_as_if_on(location: str) -> Iterator[None]:
    """Make torch.save tag CPU storages with ``location``, as a save on that GPU would."""

    def tag(storage: object) -> str | None:
        return location if getattr(storage, "device", None) == torch.device("cpu") else None

    def never(storage: object, where: str) -> None:
        return None

    torch.serialization.register_package(0, tag, never)
    try:
        yield
    finally:
        registry = torch.serialization._package_registry
        registry[:] = [entry for entry in registry if entry[1] is not tag]


def test_checkpoint_of_a_data_parallel_model_loads_into_the_plain_model(tmp_path: Path):
    source = nn.DataParallel(_net())
    torch.save(source.state_dict(), tmp_path / "dp.pt")  # the classic "module." checkpoint
    target = _net()
    report = gk.load(target, tmp_path / "dp.pt")
    assert _same_weights(target, source.module)
    assert report.prefixes_removed == ["module."]


def test_plain_checkpoint_loads_into_a_wrapped_model(tmp_path: Path):
    source = _net()
    torch.save(source.state_dict(), tmp_path / "plain.pt")
    target = nn.DataParallel(_net())
    gk.load(target, tmp_path / "plain.pt")
    assert _same_weights(target.module, source)


def test_compiled_checkpoint_inside_a_lightning_container_loads(tmp_path: Path):
    source = _net()
    state = {f"model._orig_mod.module.{k}": v for k, v in source.state_dict().items()}
    torch.save({"state_dict": state, "epoch": 4, "global_step": 80}, tmp_path / "l.ckpt")
    target = _net()
    report = gk.load(target, tmp_path / "l.ckpt")
    assert _same_weights(target, source)
    assert report.container_key == "state_dict"
    assert report.extras == {"epoch": 4, "global_step": 80}


def test_leading_segment_is_kept_when_it_is_a_real_submodule(tmp_path: Path):
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(2, 2)

    source = Outer()
    torch.save(source.state_dict(), tmp_path / "outer.pt")
    report = gk.load(Outer(), tmp_path / "outer.pt")
    assert report.prefixes_removed == []
    assert report.loaded == ["model.weight", "model.bias"]


def test_submodule_wrapped_in_data_parallel_loads_into_the_plain_submodule(tmp_path: Path):
    source = nn.Sequential(nn.DataParallel(nn.Linear(2, 2)), nn.Linear(2, 1))
    torch.save(source.state_dict(), tmp_path / "inner.pt")
    target = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    report = gk.load(target, tmp_path / "inner.pt")
    assert torch.equal(target[0].weight, source[0].module.weight.cpu())
    assert report.ok


def test_checkpoint_saved_on_cuda_1_loads_on_a_cpu_model(tmp_path: Path):
    source = _net()
    with _saved_as_if_on("cuda:1"):
        torch.save(source.state_dict(), tmp_path / "gpu.pt")
    target = _net()
    report = gk.load(target, tmp_path / "gpu.pt")
    assert _same_weights(target, source)
    assert report.source_devices == ["cuda:1"]
    assert report.device == "cpu"


def test_extras_of_a_gpu_checkpoint_arrive_on_the_model_device(tmp_path: Path):
    with _saved_as_if_on("cuda:0"):
        torch.save({"model": _net().state_dict(), "ema": torch.ones(2)}, tmp_path / "gpu.pt")
    report = gk.load(_net(), tmp_path / "gpu.pt")
    assert report.extras["ema"].device == torch.device("cpu")


def test_explicit_map_location_is_checked_against_visible_devices(tmp_path: Path):
    gk.save(_net(), tmp_path / "m.pt")
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(gk.DeviceError, match="cuda:7"):
        gk.load(_net(), tmp_path / "m.pt", map_location="cuda:7")


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_pickle_that_would_run_code_is_refused_and_the_code_never_runs(tmp_path: Path):
    marker = tmp_path / "ran.txt"
    torch.save({"model": _net().state_dict(), "x": _RunsCode(marker)}, tmp_path / "evil.pt")
    with pytest.raises(UntrustedCheckpointError, match=r"exec.*trust=True"):
        gk.load(_net(), tmp_path / "evil.pt")
    assert not marker.exists()


class Hyper:
    """A custom class in a checkpoint: harmless, but only loadable from a trusted file."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def test_trusted_file_with_custom_objects_loads_when_trust_is_given(tmp_path: Path):
    source = _net()
    torch.save({"model": source.state_dict(), "hparams": Hyper(0.1)}, tmp_path / "t.pt")
    target = _net()
    report = gk.load(target, tmp_path / "t.pt", trust=True)
    assert _same_weights(target, source)
    assert report.extras["hparams"].lr == 0.1


def test_strict_load_names_missing_and_unexpected_keys_with_nearest_matches(tmp_path: Path):
    gk.save(_net(), tmp_path / "m.pt")
    renamed = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    renamed.add_module("head", nn.Linear(3, 2))
    with pytest.raises(CheckpointError) as caught:
        gk.load(renamed, tmp_path / "m.pt")
    message = str(caught.value)
    assert "2 missing keys: head.weight (nearest in the file: 2.weight)" in message
    assert "2 unexpected keys: 2.weight (nearest in the model: head.weight)" in message
    assert "strict=False" in message


def test_strict_load_changes_nothing_when_it_refuses(tmp_path: Path):
    gk.save(_net(), tmp_path / "m.pt")
    wider = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 5))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"2\.weight \(file \[2, 3\], model \[5, 3\]\)"):
        gk.load(wider, tmp_path / "m.pt")
    assert all(torch.equal(before[k], v) for k, v in wider.state_dict().items())


def test_non_strict_load_fills_what_fits_and_reports_the_rest(tmp_path: Path):
    source = _net()
    gk.save(source, tmp_path / "m.safetensors")
    wider = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 5))
    report = gk.load(wider, tmp_path / "m.safetensors", strict=False)
    assert torch.equal(wider[0].weight, source[0].weight)
    assert report.mismatched == {"2.weight": ((2, 3), (5, 3)), "2.bias": ((2,), (5,))}
    assert not report.ok


def test_truncated_torch_file_is_a_checkpoint_error_saying_so(tmp_path: Path):
    gk.save(_net(), tmp_path / "m.pt")
    data = (tmp_path / "m.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cut short"):
        gk.load(_net(), tmp_path / "cut.pt")


def test_truncated_safetensors_file_is_a_checkpoint_error_saying_so(tmp_path: Path):
    gk.save(_net(), tmp_path / "m.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-12])
    with pytest.raises(CheckpointError, match="safetensors file"):
        gk.load(_net(), tmp_path / "cut.safetensors")


def test_foreign_file_is_a_checkpoint_error_describing_its_content(tmp_path: Path):
    (tmp_path / "notes.pt").write_text("epoch 3: loss 0.2\n")
    with pytest.raises(CheckpointError, match="not a checkpoint: its content looks like text"):
        gk.load(_net(), tmp_path / "notes.pt")


def test_missing_file_is_a_checkpoint_error(tmp_path: Path):
    with pytest.raises(CheckpointError, match="does not exist"):
        gk.load(_net(), tmp_path / "absent.pt")


def test_file_without_weights_lists_what_it_holds(tmp_path: Path):
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "meta.pt")
    with pytest.raises(CheckpointError, match=r"no model weights.*'epoch', 'lr'"):
        gk.load(_net(), tmp_path / "meta.pt")


def test_report_carries_what_gk_save_recorded(tmp_path: Path):
    gk.save(nn.DataParallel(_net()), tmp_path / "m.pt", metadata={"run": "a1"})
    report = gk.load(_net(), tmp_path / "m.pt")
    assert report.metadata["wrappers_removed"] == ["DataParallel"]
    assert report.metadata["metadata"] == {"run": "a1"}


def test_trusted_file_needing_a_module_this_python_lacks_is_a_checkpoint_error(tmp_path: Path):
    # Save an object of a class from a package that exists only while saving.
    package = types.ModuleType("no_such_training_package")

    class Config:
        pass

    Config.__module__, Config.__qualname__ = package.__name__, "Config"
    package.Config = Config  # type: ignore[attr-defined]
    sys.modules[package.__name__] = package
    try:
        torch.save({"model": _net().state_dict(), "cfg": Config()}, tmp_path / "t.pt")
    finally:
        del sys.modules[package.__name__]
    with pytest.raises(CheckpointError, match=r"need no_such_training_package.*cannot import"):
        gk.load(_net(), tmp_path / "t.pt", trust=True)


def test_trusted_file_needing_a_class_its_module_lacks_does_not_claim_corruption(tmp_path: Path):
    torch.save({"model": _net().state_dict(), "hparams": Hyper(0.1)}, tmp_path / "t.pt")
    saved = Hyper
    del globals()["Hyper"]
    try:
        with pytest.raises(CheckpointError, match=r"Hyper .*cannot import") as caught:
            gk.load(_net(), tmp_path / "t.pt", trust=True)
    finally:
        globals()["Hyper"] = saved
    assert "corrupted" not in str(caught.value)


def test_path_and_model_swapped_is_an_error_saying_which_comes_first(tmp_path: Path):
    gk.save(_net(), tmp_path / "m.pt")
    with pytest.raises(InvalidArgumentError, match=r"gk.load\(model, path\)"):
        gk.load(tmp_path / "m.pt", _net())  # type: ignore[arg-type]
