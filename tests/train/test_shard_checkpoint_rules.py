"""What gk.save does with a sharded model's path, and refuses, before any process waits for another.

A path means the same for a sharded model as for a plain one (``save_layout``, the one suffix
rule): the tests that compare the two shard the model in a group of one process, where saving
waits for nobody.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.checkpoint.dtensor import is_sharded
from gpukit.checkpoint.sharded_model import save_sharded
from gpukit.errors import InvalidArgumentError
from gpukit.train.shard import shard
from tests.train import shard_workloads as work


def _save(obj: object, path: Path, **options: object) -> Path:
    settings: dict[str, object] = {
        "layout": "sharded safetensors",
        "shard_limit": None,
        "metadata": {},
        "save_file": gk.save,
    }
    settings.update(options)
    return save_sharded(obj, path, **settings)  # type: ignore[arg-type]


def _sharded() -> nn.Module:
    return shard(work.model(), device=torch.device("cpu"), weight=lambda: 1.0)


def test_a_plain_model_is_not_taken_for_a_sharded_one() -> None:
    assert not is_sharded(nn.Linear(2, 2))
    assert not is_sharded({"model": nn.Linear(2, 2), "step": 3})


@pytest.mark.usefixtures("group_of_one")
def test_a_sharded_model_is_told_apart_alone_and_in_a_dict() -> None:
    net = _sharded()
    assert is_sharded(net)
    assert is_sharded({"model": net, "step": 3})


@pytest.mark.usefixtures("group_of_one")
@pytest.mark.parametrize("name", ["w.PT", "w.Pth", "w.BIN", "w.SafeTensors"])
def test_a_file_suffix_in_any_case_is_one_file_for_a_sharded_model_as_for_a_plain_one(
    tmp_path: Path, name: str
) -> None:
    plain = gk.save(work.model(), tmp_path / "plain" / name)
    sharded = gk.save(_sharded(), tmp_path / "sharded" / name)
    assert plain.is_file()
    assert sharded.is_file()  # the full weights, gathered
    net = work.bumped(work.model())
    assert gk.load(net, sharded).ok
    assert work.full_weights(net) == work.full_weights(work.model())


@pytest.mark.usefixtures("group_of_one")
def test_a_path_without_a_suffix_is_a_folder_for_a_sharded_model_as_for_a_plain_one(
    tmp_path: Path,
) -> None:
    assert gk.save(work.model(), tmp_path / "plain").is_dir()
    assert gk.save(_sharded(), tmp_path / "sharded").is_dir()  # a DCP folder


@pytest.mark.usefixtures("group_of_one")
def test_a_suffix_gk_save_does_not_know_is_refused_for_a_sharded_model_as_for_a_plain_one(
    tmp_path: Path,
) -> None:
    with pytest.raises(InvalidArgumentError) as plain:
        gk.save(work.model(), tmp_path / "w.v2")
    with pytest.raises(InvalidArgumentError) as sharded:
        gk.save(_sharded(), tmp_path / "w.v2")
    assert str(sharded.value) == str(plain.value)
    assert "picks the checkpoint layout from the suffix" in str(sharded.value)
    assert sharded.value.hint == plain.value.hint
    assert os.listdir(tmp_path) == []


@pytest.mark.usefixtures("group_of_one")
def test_a_file_suffix_with_a_shard_size_is_refused_for_a_sharded_model_as_for_a_plain_one(
    tmp_path: Path,
) -> None:
    with pytest.raises(InvalidArgumentError) as plain:
        gk.save(work.model(), tmp_path / "w.PT", max_shard_size="1KB")
    with pytest.raises(InvalidArgumentError) as sharded:
        gk.save(_sharded(), tmp_path / "w.PT", max_shard_size="1KB")
    assert str(sharded.value) == str(plain.value)
    assert "names one torch file" in str(sharded.value)
    assert os.listdir(tmp_path) == []


def test_metadata_for_a_dcp_folder_is_refused_with_where_to_put_it(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="has no place to keep it") as caught:
        _save(nn.Linear(2, 2), tmp_path / "ckpt", metadata={"run": "a"})
    assert '"info"' in (caught.value.hint or "")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("name", "layout", "limit"),
    [("model.safetensors", "safetensors", None), ("weights", "sharded safetensors", 10**9)],
)
def test_a_dict_is_refused_where_only_full_weights_are_written(
    tmp_path: Path, name: str, layout: str, limit: int | None
) -> None:
    state = {"model": nn.Linear(2, 2), "optimizer": None}
    with pytest.raises(InvalidArgumentError, match="only the model's weights"):
        _save(state, tmp_path / name, layout=layout, shard_limit=limit)


def test_two_models_in_one_dcp_folder_are_refused(tmp_path: Path) -> None:
    two = {"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "x": torch.zeros(1)}
    with pytest.raises(InvalidArgumentError, match="with 2 models"):
        _save(two, tmp_path / "ckpt")
