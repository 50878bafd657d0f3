"""gk.save: clean keys whatever wrapped the model, a format from the suffix, metadata recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import gpukit as gk
from gpukit.errors import CheckpointError, InvalidArgumentError


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def _expected_keys() -> list[str]:
    return list(_net().state_dict())


def test_save_removes_stacked_data_parallel_wrappers(tmp_path: Path):
    gk.save(nn.DataParallel(nn.DataParallel(_net())), tmp_path / "m.pt")
    assert list(torch.load(tmp_path / "m.pt", weights_only=True)) == _expected_keys()


def test_save_removes_gpukit_data_parallel_around_a_compiled_model(tmp_path: Path):
    wrapped = gk.DataParallel(torch.compile(_net()), device_ids=["cpu"] * 2)
    gk.save(wrapped, tmp_path / "m.pt")
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(state) == _expected_keys()
    assert state._gpukit_metadata["wrappers_removed"] == ["DataParallel", "OptimizedModule"]


def test_save_removes_torch_compile_around_data_parallel(tmp_path: Path):
    compiled = torch.compile(nn.DataParallel(_net()))
    gk.save(compiled, tmp_path / "m.safetensors")
    assert list(load_file(tmp_path / "m.safetensors")) == _expected_keys()


def test_save_removes_distributed_data_parallel(tmp_path: Path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gk.save(nn.parallel.DistributedDataParallel(_net()), tmp_path / "m.pt")
    finally:
        dist.destroy_process_group()
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(state) == _expected_keys()
    assert state._gpukit_metadata["wrappers_removed"] == ["DistributedDataParallel"]


def test_saved_torch_file_loads_with_bare_torch_into_the_plain_model(tmp_path: Path):
    source = nn.DataParallel(_net())
    gk.save(source, tmp_path / "m.pth")
    target = _net()
    target.load_state_dict(torch.load(tmp_path / "m.pth", weights_only=True))
    assert torch.equal(target[0].weight, source.module[0].weight.cpu())


def test_save_records_versions_wrappers_devices_and_user_metadata(tmp_path: Path):
    model = nn.DataParallel(_net())  # moved onto the GPU where there is one
    gk.save(model, tmp_path / "m.safetensors", metadata={"epoch": 7})
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as handle:
        info = json.loads(handle.metadata()["gpukit"])
    assert info["gpukit_version"] == gk.__version__
    assert info["torch_version"] == str(torch.__version__)
    assert info["wrappers_removed"] == ["DataParallel"]
    assert info["devices"] == [str(model.module[0].weight.device)]
    assert info["metadata"] == {"epoch": 7}


def test_save_of_a_dict_stores_optimizer_state_that_loads_without_trust(tmp_path: Path):
    model = nn.DataParallel(_net())
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    gk.save({"model": model, "optimizer": optimizer, "epoch": 3}, tmp_path / "run.pt")
    loaded = torch.load(tmp_path / "run.pt", weights_only=True)
    assert list(loaded["model"]) == _expected_keys()
    assert loaded["epoch"] == 3
    fresh = torch.optim.Adam(_net().parameters())
    fresh.load_state_dict(loaded["optimizer"])
    assert fresh.state_dict()["state"][0]["step"] == 1


def test_save_cleans_a_prefixed_state_dict_given_directly(tmp_path: Path):
    state = nn.DataParallel(_net()).state_dict()
    gk.save(state, tmp_path / "m.pt")
    assert list(torch.load(tmp_path / "m.pt", weights_only=True)) == _expected_keys()


def test_save_refuses_non_tensor_entries_in_a_safetensors_file(tmp_path: Path):
    with pytest.raises(CheckpointError, match=r"'epoch'.*\.pt"):
        gk.save({"model": _net(), "epoch": 3}, tmp_path / "run.safetensors")
    assert not list(tmp_path.iterdir())


def test_save_refuses_an_unknown_suffix_naming_the_known_ones(tmp_path: Path):
    with pytest.raises(InvalidArgumentError, match=r"\.safetensors.*\.pt"):
        gk.save(_net(), tmp_path / "m.weights")


def test_save_refuses_metadata_that_is_not_json(tmp_path: Path):
    with pytest.raises(InvalidArgumentError, match="JSON"):
        gk.save(_net(), tmp_path / "m.pt", metadata={"when": object()})


def test_save_refuses_a_bare_tensor_saying_what_it_takes(tmp_path: Path):
    with pytest.raises(InvalidArgumentError, match="module, a state dict, or a dict"):
        gk.save(torch.zeros(3), tmp_path / "m.pt")


def test_save_makes_the_missing_folders_of_a_sharded_folder_as_the_readme_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    model = _net()
    gk.save(model, "run/weights")  # run/ does not exist yet
    target = _net()
    assert gk.load(target, "run/weights").ok
    saved, loaded = model.state_dict(), target.state_dict()
    assert list(loaded) == list(saved)
    assert all(torch.equal(loaded[key], saved[key]) for key in saved)


def test_save_makes_every_missing_parent_folder_of_a_file(tmp_path: Path):
    gk.save(_net(), tmp_path / "a" / "b" / "m.pt")
    assert list(torch.load(tmp_path / "a" / "b" / "m.pt", weights_only=True)) == _expected_keys()


def test_save_under_a_file_is_refused_and_creates_nothing(tmp_path: Path):
    (tmp_path / "notes").write_text("x")
    with pytest.raises(CheckpointError, match="notes is a file, not a folder"):
        gk.save(_net(), tmp_path / "notes" / "run" / "m.pt")


def test_save_under_a_folder_it_cannot_write_is_refused_and_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from gpukit.checkpoint import paths

    (tmp_path / "ro").mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anywhere: judge the folder as any other user would
        real = paths._access
        monkeypatch.setattr(
            paths, "_access", lambda p, mode: False if p == tmp_path / "ro" else real(p, mode)
        )
    with pytest.raises(CheckpointError, match="not writable by this user"):
        gk.save(_net(), tmp_path / "ro" / "run" / "m.pt")
    assert not (tmp_path / "ro" / "run").exists()


def test_save_to_a_file_suffix_with_a_shard_size_is_refused(tmp_path: Path):
    for name in ("m.pt", "m.pth", "m.safetensors"):
        with pytest.raises(InvalidArgumentError, match="Drop max_shard_size to write one file"):
            gk.save(_net(), tmp_path / name, max_shard_size="2GB")
        assert not (tmp_path / name).exists()


def test_a_refused_object_leaves_no_new_folder_behind(tmp_path: Path):
    with pytest.raises(InvalidArgumentError):
        gk.save(torch.zeros(3), tmp_path / "run" / "m.pt")
    assert not (tmp_path / "run").exists()


def test_saved_file_gets_the_permissions_of_an_ordinary_new_file(tmp_path: Path):
    umask = os.umask(0o022)
    os.umask(umask)
    path = gk.save(_net(), tmp_path / "m.safetensors")
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def _tied() -> nn.Sequential:
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    return model


def test_tied_weights_are_stored_once_in_safetensors_and_load_back_tied(tmp_path: Path):
    source = _tied()
    gk.save(source, tmp_path / "tied.safetensors")
    assert list(load_file(tmp_path / "tied.safetensors")) == ["0.weight"]
    target = _tied()
    report = gk.load(target, tmp_path / "tied.safetensors")
    assert report.ok
    assert report.tied == {"1.weight": "0.weight"}
    assert torch.equal(target[1].weight, source[0].weight)
    assert target[1].weight is target[0].weight


def test_weights_tied_at_save_fill_both_parameters_of_an_untied_model(tmp_path: Path):
    source = _tied()
    gk.save(source, tmp_path / "tied.safetensors")
    target = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    gk.load(target, tmp_path / "tied.safetensors")
    assert torch.equal(target[0].weight, source[0].weight)
    assert torch.equal(target[1].weight, source[0].weight)


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool]


@settings(max_examples=30, deadline=None)
@given(
    tensors=st.dictionaries(
        st.from_regex(r"[a-z]{1,5}(\.[a-z0-9]{1,3}){0,2}", fullmatch=True),
        st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 4), max_size=3)),
        min_size=1,
        max_size=6,
    )
)
def test_safetensors_written_by_save_read_back_equal_with_the_safetensors_library(
    tmp_path_factory: pytest.TempPathFactory, tensors: dict[str, tuple[torch.dtype, list[int]]]
):
    state = {
        key: (torch.randn(shape) * 10).to(dtype).transpose(0, -1) if shape else torch.tensor(1)
        for key, (dtype, shape) in tensors.items()
    }
    path = gk.save(state, tmp_path_factory.mktemp("st") / "t.safetensors")
    loaded = load_file(path)
    assert sorted(loaded) == sorted(state)
    for key, tensor in state.items():
        assert loaded[key].dtype == tensor.dtype
        assert torch.equal(loaded[key], tensor)
