"""gk.checkpoint.convert and gk.checkpoint.describe, called as a library (the CLI renders them)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn

import gpukit as gk
from gpukit.checkpoint import sharded
from gpukit.errors import CheckpointError, InvalidArgumentError, UntrustedCheckpointError


def _model() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _training_checkpoint(path: Path) -> nn.Module:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = {"model": nn.DataParallel(model).state_dict(), "optimizer": optimizer.state_dict()}
    torch.save({**state, "epoch": 7}, path)
    return model


class _Sampler:
    def __init__(self) -> None:
        self.seen = 3


def _dcp_with_a_pickle(folder: Path, model: nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict(), "sampler": _Sampler()}, checkpoint_id=folder)


def test_the_checkpoint_package_offers_convert_and_describe_from_gk() -> None:
    assert gk.checkpoint.convert is gk.checkpoint.conversion.convert
    assert gk.checkpoint.describe is gk.checkpoint.description.describe


# -- describe -------------------------------------------------------------------------------


def test_describe_says_where_the_weights_are_and_what_sits_beside_them(tmp_path: Path) -> None:
    _training_checkpoint(tmp_path / "last.pt")
    found = gk.checkpoint.describe(tmp_path / "last.pt")
    assert (found.format, found.layout) == ("torch", "file")
    assert found.container_key == "model"
    assert found.other_entries == {"optimizer": "dict of 2", "epoch": "7"}
    assert found.prefixes == ["module."]
    assert found.wrappers == ["nn.DataParallel or DistributedDataParallel"]
    assert found.parameter_count == 4 * 3 + 3 + 3 * 2 + 2
    assert found.tensors[0].key == "module.0.weight"
    assert found.tensors[0].shape == [3, 4]
    assert found.files == {}
    assert found.shard_count is None
    assert found.size == (tmp_path / "last.pt").stat().st_size


def test_describe_of_a_sharded_folder_lists_its_files_without_reading_a_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = gk.save(_model(), tmp_path / "weights", max_shard_size=64)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("describe read a tensor")

    monkeypatch.setattr(sharded, "_read_shard", refuse)
    found = gk.checkpoint.describe(folder)
    assert found.layout == "sharded"
    assert found.index == "model.safetensors.index.json"
    assert list(found.files)[-1] == found.index
    assert found.shard_count == len(found.files) - 1 > 1
    assert found.size == sum(p.stat().st_size for p in folder.iterdir())
    assert found.parameter_count == 4 * 3 + 3 + 3 * 2 + 2


def test_describe_of_a_file_without_weights_lists_every_entry(tmp_path: Path) -> None:
    torch.save({"epoch": 3, "notes": "x"}, tmp_path / "meta.pt")
    found = gk.checkpoint.describe(tmp_path / "meta.pt")
    assert not found.weights_found
    assert found.other_entries == {"epoch": "3", "notes": "'x'"}
    assert found.tensors == []


def test_describe_json_carries_its_schema_and_the_same_facts(tmp_path: Path) -> None:
    gk.save(_model(), tmp_path / "m.safetensors")
    payload = gk.checkpoint.describe(tmp_path / "m.safetensors").to_json()
    assert payload["schema"] == "gpukit.ckpt.show/1"
    assert payload["tensor_count"] == 4
    assert payload["tensors"][1] == {
        "key": "0.bias",
        "shape": [3],
        "dtype": "float32",
        "device": "cpu",
        "numel": 3,
    }


def test_describe_refuses_a_trust_that_is_not_a_bool(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="trust"):
        gk.checkpoint.describe(tmp_path / "m.pt", trust="yes")  # type: ignore[arg-type]


# -- convert --------------------------------------------------------------------------------


def test_convert_to_safetensors_keeps_the_weights_and_returns_what_it_left_out(
    tmp_path: Path,
) -> None:
    model = _training_checkpoint(tmp_path / "last.pt")
    done = gk.checkpoint.convert(tmp_path / "last.pt", tmp_path / "w.safetensors")
    assert done.output == tmp_path / "w.safetensors"
    assert done.format == "safetensors"
    assert done.left_out == ["optimizer", "epoch"]
    assert done.kept == "the weights under 'model'"
    assert not done.weights_only_asked
    assert done.prefixes_removed == ["module."]
    written = load_file(tmp_path / "w.safetensors")
    assert list(written) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert torch.equal(written["2.bias"], model[2].bias.detach())


def test_convert_to_pt_keeps_everything_unless_weights_only_is_asked(tmp_path: Path) -> None:
    _training_checkpoint(tmp_path / "last.pt")
    whole = gk.checkpoint.convert(tmp_path / "last.pt", tmp_path / "all.pt")
    assert (whole.left_out, whole.kept) == ([], "everything")
    assert set(torch.load(tmp_path / "all.pt", weights_only=True)) == {
        "model",
        "optimizer",
        "epoch",
    }
    weights = gk.checkpoint.convert(tmp_path / "last.pt", tmp_path / "w.pt", weights_only=True)
    assert weights.weights_only_asked
    assert weights.left_out == ["optimizer", "epoch"]
    assert set(torch.load(tmp_path / "w.pt", weights_only=True)) == {
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    }


def test_convert_to_a_sharded_folder_says_so_and_records_where_it_came_from(
    tmp_path: Path,
) -> None:
    _training_checkpoint(tmp_path / "last.pt")
    done = gk.checkpoint.convert(tmp_path / "last.pt", tmp_path / "out", max_shard_size=64)
    assert done.sharded
    assert done.format == "sharded safetensors"
    recorded = gk.checkpoint.describe(tmp_path / "out").metadata["metadata"]
    assert recorded == {"converted_from": "last.pt", "source_devices": ["cpu"]}


def test_convert_to_safetensors_never_unpickles_the_entries_it_leaves_out(tmp_path: Path) -> None:
    model = _model()
    _dcp_with_a_pickle(tmp_path / "dcp", model)
    done = gk.checkpoint.convert(tmp_path / "dcp", tmp_path / "w.safetensors")
    assert done.left_out == ["sampler"]
    assert torch.equal(load_file(tmp_path / "w.safetensors")["0.weight"], model[0].weight.detach())
    with pytest.raises(UntrustedCheckpointError):
        gk.checkpoint.convert(tmp_path / "dcp", tmp_path / "all.pt")
    assert not (tmp_path / "all.pt").exists()


def test_convert_of_a_checkpoint_without_weights_to_safetensors_is_refused_writing_nothing(
    tmp_path: Path,
) -> None:
    torch.save({"epoch": 3}, tmp_path / "meta.pt")
    with pytest.raises(CheckpointError, match="holds no model weights to convert") as caught:
        gk.checkpoint.convert(tmp_path / "meta.pt", tmp_path / "w.safetensors")
    assert "Convert to a .pt file" in caught.value.hint
    assert not (tmp_path / "w.safetensors").exists()


def test_convert_refuses_an_unknown_output_suffix_before_reading_the_input(tmp_path: Path) -> None:
    (tmp_path / "in.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(InvalidArgumentError, match="suffix"):
        gk.checkpoint.convert(tmp_path / "in.pt", tmp_path / "out.onnx")


def test_convert_refuses_a_weights_only_that_is_not_a_bool(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="weights_only"):
        gk.checkpoint.convert(tmp_path / "in.pt", tmp_path / "o.pt", weights_only=1)  # type: ignore[arg-type]


def test_convert_takes_a_checked_target_but_not_a_second_shard_size_beside_it(
    tmp_path: Path,
) -> None:
    from gpukit.checkpoint.api import check_save_target

    _training_checkpoint(tmp_path / "last.pt")
    planned = check_save_target(tmp_path / "out", 64)
    with pytest.raises(InvalidArgumentError, match="max_shard_size"):
        gk.checkpoint.convert(tmp_path / "last.pt", planned, max_shard_size=128)
    assert not (tmp_path / "out").exists()
    assert gk.checkpoint.convert(tmp_path / "last.pt", planned).sharded
