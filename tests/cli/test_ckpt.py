"""`gpukit ckpt show|convert`, run as a user would."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

import gpukit as gk


def _dp_checkpoint(path: Path) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    torch.save({"model": nn.DataParallel(model).state_dict(), "epoch": 5}, path)
    return model


def test_show_json_lists_tensors_wrappers_and_other_entries(tmp_path: Path, run_cli):
    _dp_checkpoint(tmp_path / "dp.pt")
    result = run_cli("ckpt", "show", str(tmp_path / "dp.pt"), "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["schema"] == "gpukit.ckpt.show/1"
    assert payload["format"] == "torch"
    assert payload["prefixes"] == ["module."]
    assert payload["wrappers"] == ["nn.DataParallel or DistributedDataParallel"]
    assert payload["container_key"] == "model"
    assert payload["other_entries"] == {"epoch": "5"}
    assert payload["parameter_count"] == 4 * 3 + 3 + 3 * 2 + 2
    first = payload["tensors"][0]
    assert first == {
        "key": "module.0.weight",
        "shape": [3, 4],
        "dtype": "float32",
        "device": "cpu",
        "numel": 12,
    }


def test_show_prints_a_tree_with_shapes_and_parameter_counts(tmp_path: Path, run_cli):
    gk.save(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), tmp_path / "m.safetensors")
    result = run_cli("ckpt", "show", str(tmp_path / "m.safetensors"), env={"NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    assert "safetensors" in result.stdout
    assert "0 (15 params)" in result.stdout
    assert "weight  [3, 4]  float32  cpu  12" in result.stdout
    assert f"saved by gpukit {gk.__version__}" in result.stdout


def test_show_of_a_truncated_file_is_one_line_without_traceback(tmp_path: Path, run_cli):
    _dp_checkpoint(tmp_path / "dp.pt")
    data = (tmp_path / "dp.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:300])
    result = run_cli("ckpt", "show", str(tmp_path / "cut.pt"))
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "cut short" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_convert_of_a_training_checkpoint_to_safetensors_keeps_weights_and_names_the_rest(
    tmp_path: Path, run_cli
):
    model = nn.DataParallel(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 7}
    torch.save(state, tmp_path / "train.pt")
    out = tmp_path / "model.safetensors"
    result = run_cli("ckpt", "convert", str(tmp_path / "train.pt"), str(out), env={"NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    assert "left out optimizer, epoch" in result.stdout
    assert list(load_file(out)) == ["weight", "bias"]
    assert torch.equal(load_file(out)["weight"], model.module.weight.detach())


def test_convert_cleans_keys_and_loads_into_the_plain_model_with_bare_safetensors(
    tmp_path: Path, run_cli
):
    source = _dp_checkpoint(tmp_path / "dp.pt")
    out = tmp_path / "clean.safetensors"
    result = run_cli("ckpt", "convert", str(tmp_path / "dp.pt"), str(out), "--weights-only")
    assert result.returncode == 0, result.stderr
    target = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    target.load_state_dict(load_file(out))
    assert torch.equal(target[2].weight, source[2].weight)


def test_convert_to_pt_keeps_every_entry(tmp_path: Path, run_cli):
    _dp_checkpoint(tmp_path / "dp.pt")
    result = run_cli("ckpt", "convert", str(tmp_path / "dp.pt"), str(tmp_path / "clean.pt"))
    assert result.returncode == 0, result.stderr
    loaded = torch.load(tmp_path / "clean.pt", weights_only=True)
    assert loaded["epoch"] == 5
    assert list(loaded["model"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_show_of_a_file_without_a_state_dict_lists_what_it_holds(tmp_path: Path, run_cli):
    torch.save({"w": torch.zeros(2), "step": 3}, tmp_path / "loose.pt")
    result = run_cli("ckpt", "show", str(tmp_path / "loose.pt"), "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["weights_found"] is False
    assert payload["other_entries"] == {"w": "tensor [2]", "step": "3"}
    human = run_cli("ckpt", "show", str(tmp_path / "loose.pt"), env={"NO_COLOR": "1"})
    assert "no model weights found" in human.stdout
    assert "w: tensor [2], step: 3" in human.stdout
