"""`gpukit ckpt show|convert`, run as a user would."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
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
    assert torch.equal(load_file(out)["weight"], model.module.weight.detach().cpu())


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
    torch.save({"names": ["a", "b"], "step": 3}, tmp_path / "loose.pt")
    result = run_cli("ckpt", "show", str(tmp_path / "loose.pt"), "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["weights_found"] is False
    assert payload["other_entries"] == {"names": "list", "step": "3"}
    human = run_cli("ckpt", "show", str(tmp_path / "loose.pt"), env={"NO_COLOR": "1"})
    assert "no model weights found" in human.stdout
    assert "names: list, step: 3" in human.stdout


def _one_line_usage_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


def _sharded(folder: Path) -> nn.Module:
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    gk.save(model, folder, max_shard_size=1024)
    return model


def test_show_json_of_a_sharded_folder_lists_its_shards_and_tensors(tmp_path: Path, run_cli):
    _sharded(tmp_path / "weights")
    result = run_cli("ckpt", "show", str(tmp_path / "weights"), "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["schema"] == "gpukit.ckpt.show/1"
    assert payload["format"] == "sharded safetensors"
    assert payload["layout"] == "sharded"
    names = [f["name"] for f in payload["files"]]
    assert names == [
        "model-00001-of-00002.safetensors",  # 0.weight (2 KiB) alone: over the 1 KiB limit
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert payload["size_bytes"] == sum(f["size_bytes"] for f in payload["files"])
    assert payload["shard_count"] == 2
    assert payload["index_file"] == "model.safetensors.index.json"
    assert payload["tensors"][0] == {
        "key": "0.weight",
        "shape": [32, 16],
        "dtype": "float32",
        "device": "cpu",
        "numel": 512,
    }
    assert payload["parameter_count"] == 16 * 32 + 32 + 32 * 4 + 4


def test_show_of_a_dcp_folder_prints_its_files_and_key_tree(tmp_path: Path, run_cli):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            {"model": model.state_dict(), "step": 9}, checkpoint_id=tmp_path / "dcp", no_dist=True
        )
    result = run_cli("ckpt", "show", str(tmp_path / "dcp"), env={"NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    assert f"{tmp_path / 'dcp'}: dcp," in result.stdout
    assert "1 data file (__0_0.distcp" in result.stdout
    assert "index .metadata" in result.stdout
    assert "weights under 'model'; other entries: step: object (not read)" in result.stdout
    assert "weight  [3, 4]  float32  n/a  12" in result.stdout


def test_convert_goes_from_dcp_to_a_sharded_folder_to_one_file(tmp_path: Path, run_cli):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    to_folder = run_cli(
        "ckpt", "convert", str(tmp_path / "dcp"), str(tmp_path / "st"), "--max-shard-size", "64"
    )
    assert to_folder.returncode == 0, to_folder.stderr
    assert (tmp_path / "st" / "model.safetensors.index.json").is_file()
    to_file = run_cli("ckpt", "convert", str(tmp_path / "st"), str(tmp_path / "one.safetensors"))
    assert to_file.returncode == 0, to_file.stderr
    assert list(load_file(tmp_path / "one.safetensors")) == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
    ]
    target = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    gk.load(target, tmp_path / "one.safetensors")
    assert torch.equal(target[1].weight, model[1].weight)


def test_show_says_when_the_suffix_does_not_match_the_content(tmp_path: Path, run_cli):
    torch.save(nn.Linear(2, 2).state_dict(), tmp_path / "model.safetensors")
    result = run_cli("ckpt", "show", str(tmp_path / "model.safetensors"), env={"NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    assert "named .safetensors but holds a torch.save file" in result.stdout
    payload = json.loads(
        run_cli("ckpt", "show", str(tmp_path / "model.safetensors"), "--json").stdout
    )
    assert payload["format"] == "torch"
    assert payload["suffix_mismatch"] == "named .safetensors but holds a torch.save file"


def test_convert_into_a_folder_with_other_files_is_refused_and_leaves_it_alone(
    tmp_path: Path, run_cli
):
    _dp_checkpoint(tmp_path / "a.pt")
    (tmp_path / "existing_folder").mkdir()
    (tmp_path / "existing_folder" / "notes.txt").write_text("mine")
    error = _one_line_usage_error(
        run_cli("ckpt", "convert", str(tmp_path / "a.pt"), str(tmp_path / "existing_folder"))
    )
    assert "notes.txt" in error
    assert [p.name for p in (tmp_path / "existing_folder").iterdir()] == ["notes.txt"]


def test_convert_onto_a_folder_named_like_a_file_is_refused(tmp_path: Path, run_cli):
    _dp_checkpoint(tmp_path / "a.pt")
    (tmp_path / "b.pt").mkdir()
    error = _one_line_usage_error(
        run_cli("ckpt", "convert", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    )
    assert "a folder of that name exists" in error


def test_convert_under_a_file_is_refused_before_the_input_is_read(tmp_path: Path, run_cli):
    (tmp_path / "broken.pt").write_bytes(b"PK\x03\x04 not really a checkpoint")
    (tmp_path / "notes").write_text("a file, not a folder")
    output = tmp_path / "notes" / "run" / "x.pt"
    error = _one_line_usage_error(
        run_cli("ckpt", "convert", str(tmp_path / "broken.pt"), str(output))
    )
    assert f"{tmp_path / 'notes'} is a file, not a folder" in error


def test_convert_into_a_missing_folder_creates_it_as_gk_save_does(tmp_path: Path, run_cli):
    source = _dp_checkpoint(tmp_path / "dp.pt")
    output = tmp_path / "exports" / "v1" / "clean.safetensors"
    result = run_cli("ckpt", "convert", str(tmp_path / "dp.pt"), str(output))
    assert result.returncode == 0, result.stderr
    assert torch.equal(load_file(output)["2.weight"], source[2].weight.detach())


def test_convert_to_a_file_suffix_with_a_shard_size_is_a_one_line_usage_error(
    tmp_path: Path, run_cli
):
    _dp_checkpoint(tmp_path / "dp.pt")
    for name in ("out.pt", "out.pth", "out.safetensors"):
        error = _one_line_usage_error(
            run_cli(
                "ckpt",
                "convert",
                str(tmp_path / "dp.pt"),
                str(tmp_path / name),
                "--max-shard-size",
                "2GB",
            )
        )
        assert f"{name} names one" in error
        assert (
            "Drop --max-shard-size to write one file, or name the folder without a suffix" in error
        )
        assert not (tmp_path / name).exists()


def test_convert_weights_only_to_pt_says_that_dropping_the_flag_keeps_everything(
    tmp_path: Path, run_cli
):
    _dp_checkpoint(tmp_path / "dp.pt")
    result = run_cli(
        "ckpt",
        "convert",
        str(tmp_path / "dp.pt"),
        str(tmp_path / "w.pt"),
        "--weights-only",
        env={"NO_COLOR": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "left out epoch" in result.stdout
    assert "drop --weights-only to keep everything" in result.stdout
    assert ".pt" not in result.stdout.split("left out", 1)[1]
    assert list(torch.load(tmp_path / "w.pt", weights_only=True)) == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    ]


class _SamplerState:
    """A training loop's own object, saved beside the weights (only its code can rebuild it)."""

    def __init__(self) -> None:
        self.epoch = 2


def _dcp(state: dict[str, object], folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=folder, no_dist=True)


def test_convert_to_safetensors_reads_no_pickle_of_the_entries_it_drops(tmp_path: Path, run_cli):
    model = nn.Linear(4, 2)
    _dcp({"model": model.state_dict(), "sampler": _SamplerState()}, tmp_path / "dcp")
    output = tmp_path / "w.safetensors"
    result = run_cli("ckpt", "convert", str(tmp_path / "dcp"), str(output), env={"NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    assert "left out sampler" in result.stdout
    assert "convert to a .pt file to keep everything" in result.stdout
    assert torch.equal(load_file(output)["weight"], model.weight.detach())
    # What keeps the object still needs the trust that unpickling it takes.
    refused = run_cli("ckpt", "convert", str(tmp_path / "dcp"), str(tmp_path / "all.pt"))
    assert refused.returncode == 2
    assert "--trust" in refused.stderr


def _torchtitan_folder(folder: Path) -> nn.Module:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    _dcp(
        {**model.state_dict(), "optimizer": optimizer.state_dict(), "train_state": {"step": 3}},
        folder,
    )
    return model


def test_show_of_a_torchtitan_folder_counts_its_top_level_tensors_as_the_weights(
    tmp_path: Path, run_cli
):
    _torchtitan_folder(tmp_path / "step-3")
    result = run_cli("ckpt", "show", str(tmp_path / "step-3"), "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["tensor_count"] == 2
    assert [row["key"] for row in payload["tensors"]] == ["weight", "bias"]
    assert payload["weights_at_top_level"] is True
    assert set(payload["other_entries"]) == {"optimizer", "train_state"}
    human = run_cli("ckpt", "show", str(tmp_path / "step-3"), env={"NO_COLOR": "1"})
    assert ": dcp, " in human.stdout
    assert "2 tensors, 10 params" in human.stdout
    assert "weights the top-level tensors (no nested state dict); other entries: optimizer" in (
        human.stdout
    )


def test_convert_of_a_torchtitan_folder_to_safetensors_keeps_its_top_level_tensors(
    tmp_path: Path, run_cli
):
    model = _torchtitan_folder(tmp_path / "step-3")
    output = tmp_path / "w.safetensors"
    result = run_cli(
        "ckpt", "convert", str(tmp_path / "step-3"), str(output), env={"NO_COLOR": "1"}
    )
    assert result.returncode == 0, result.stderr
    assert "left out optimizer, train_state: kept only the top-level tensors" in result.stdout
    assert torch.equal(load_file(output)["bias"], model.bias.detach())


def test_show_and_convert_of_an_accelerate_save_state_folder_read_no_pickle(
    tmp_path: Path, run_cli
):
    accelerate = pytest.importorskip(
        "accelerate", reason="accelerate is not installed (pip install 'gpukit[bench]')"
    )
    accelerator = accelerate.Accelerator(cpu=True)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.save_state(str(tmp_path / "state"))
    shown = run_cli("ckpt", "show", str(tmp_path / "state"), "--json")
    assert shown.returncode == 0, shown.stderr
    payload = json.loads(shown.stdout)
    assert payload["layout"] == "accelerate"
    assert payload["tensor_count"] == 2
    assert payload["container_key"] == "model"
    assert payload["other_entries"] == {
        "optimizer": "object (not read)",
        "random_states_0": "object (not read)",
    }
    assert {f["name"] for f in payload["files"]} == {
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
    }
    output = tmp_path / "w.safetensors"
    result = run_cli("ckpt", "convert", str(tmp_path / "state"), str(output), env={"NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    assert "left out optimizer, random_states_0" in result.stdout
    assert torch.equal(load_file(output)["weight"], model.weight.detach())


def test_show_of_a_fifo_is_refused_at_once_instead_of_hanging(tmp_path: Path, run_cli):
    os.mkfifo(tmp_path / "pipe.pt")
    error = _one_line_usage_error(run_cli("ckpt", "show", str(tmp_path / "pipe.pt"), timeout=60))
    assert "FIFO" in error


_COMMAND_MODULES = (
    "gpukit.cli.main",
    "gpukit.cli.ckpt",
    "gpukit.cli._output",
    "gpukit.checkpoint.api",
    "gpukit.checkpoint.layout",
    "rich.console",
)


@contextlib.contextmanager
def _as_unprivileged_user() -> Iterator[None]:
    """Drop to an ordinary user's rights (root ignores file modes); nothing to do otherwise.

    That user may not be able to read this checkout or this Python at all (a clone in a 0700
    folder), so nothing may be imported while acting as them: each test runs its command as
    root first, which imports all of it. A module imported in the block anyway fails the test
    here, in every order and every clone, instead of only where it could not be read.
    """
    if os.geteuid() != 0:
        yield
        return
    for name in _COMMAND_MODULES:
        importlib.import_module(name)
    before = set(sys.modules)
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
    imported = sorted(set(sys.modules) - before)
    assert not imported, f"imported while acting as another user: {imported}"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder an unprivileged user can reach (pytest's tmp_path is private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="gpukit-ckpt-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        for path in folder.rglob("*"):
            path.chmod(0o755)
        shutil.rmtree(folder)


def test_convert_into_a_read_only_folder_is_a_one_line_usage_error(shared_dir: Path, capsys):
    from gpukit.cli.main import main

    _dp_checkpoint(shared_dir / "a.pt")
    (shared_dir / "a.pt").chmod(0o644)
    (shared_dir / "ro").mkdir()
    (shared_dir / "ro").chmod(0o555)
    assert main(["ckpt", "convert", str(shared_dir / "a.pt"), str(shared_dir / "b.pt")]) == 0
    capsys.readouterr()
    with _as_unprivileged_user():
        code = main(["ckpt", "convert", str(shared_dir / "a.pt"), str(shared_dir / "ro" / "b.pt")])
    err = capsys.readouterr().err
    assert code == 2
    assert "is not writable by this user" in err
    assert len(err.strip().splitlines()) == 1


def test_show_of_an_unreadable_file_is_a_one_line_usage_error(shared_dir: Path, capsys):
    from gpukit.cli.main import main

    _dp_checkpoint(shared_dir / "secret.pt")
    (shared_dir / "secret.pt").chmod(0o000)
    assert main(["ckpt", "show", str(shared_dir / "secret.pt")]) == 0  # root may read it
    capsys.readouterr()
    with _as_unprivileged_user():
        code = main(["ckpt", "show", str(shared_dir / "secret.pt")])
    err = capsys.readouterr().err
    assert code == 2
    assert "permission denied" in err
    assert len(err.strip().splitlines()) == 1
