"""What gk.save refuses of a sharded model before any process waits for another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.checkpoint.sharded_model import is_sharded_model, save_sharded
from gpukit.errors import InvalidArgumentError


def _save(obj: object, path: Path, **options: object) -> Path:
    settings: dict[str, object] = {"metadata": {}, "max_shard_size": None, "save_file": gk.save}
    settings.update(options)
    return save_sharded(obj, path, **settings)  # type: ignore[arg-type]


def test_a_plain_model_is_not_taken_for_a_sharded_one() -> None:
    assert not is_sharded_model(nn.Linear(2, 2))
    assert not is_sharded_model({"model": nn.Linear(2, 2), "step": 3})


def test_metadata_for_a_dcp_folder_is_refused_with_where_to_put_it(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="has no place to keep it") as caught:
        _save(nn.Linear(2, 2), tmp_path / "ckpt", metadata={"run": "a"})
    assert '"info"' in (caught.value.hint or "")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(("name", "limit"), [("model.safetensors", None), ("weights", "1GB")])
def test_a_dict_is_refused_where_only_full_weights_are_written(
    tmp_path: Path, name: str, limit: str | None
) -> None:
    state = {"model": nn.Linear(2, 2), "optimizer": None}
    with pytest.raises(InvalidArgumentError, match="only the model's weights"):
        _save(state, tmp_path / name, max_shard_size=limit)


def test_a_file_name_with_a_shard_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="names one file"):
        _save(nn.Linear(2, 2), tmp_path / "model.safetensors", max_shard_size="1GB")


def test_two_models_in_one_dcp_folder_are_refused(tmp_path: Path) -> None:
    two = {"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "x": torch.zeros(1)}
    with pytest.raises(InvalidArgumentError, match="with 2 models"):
        _save(two, tmp_path / "ckpt")
