"""Checkpoint folders (sharded safetensors or .bin with an index, DCP) made by the real tools."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import load_torch_model, save_torch_state_dict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import nn

import gpukit as gk
from gpukit.checkpoint.dcp import open_dcp
from gpukit.errors import CheckpointError, InvalidArgumentError, UntrustedCheckpointError
from tests.conftest import subprocess_env


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16), nn.BatchNorm1d(16))


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    # On CPU: with one GPU, nn.DataParallel moves the model it wraps onto it.
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


def _trained() -> nn.Sequential:
    torch.manual_seed(1)
    model = _net()
    with torch.no_grad():
        model[3].running_mean.uniform_()
        model[3].num_batches_tracked.fill_(7)
    return model


def _dcp_save(state: dict[str, object], folder: Path) -> None:
    """torch.distributed.checkpoint.save on one process, as a single-GPU FSDP run would."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=folder, no_dist=True)


def _hf_folder(folder: Path, state: dict[str, torch.Tensor], **kwargs: object) -> Path:
    folder.mkdir()
    save_torch_state_dict(state, folder, max_shard_size=4096, **kwargs)  # type: ignore[arg-type]
    return folder


def test_hugging_face_sharded_safetensors_folder_loads_with_nothing_missing(tmp_path: Path):
    source = _trained()
    folder = _hf_folder(tmp_path / "hf", source.state_dict())
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    target = _net()
    report = gk.load(target, folder)
    assert report.ok
    assert report.format == "sharded safetensors"
    assert _same_weights(target, source)


def test_the_index_file_itself_may_be_given_instead_of_the_folder(tmp_path: Path):
    source = _trained()
    folder = _hf_folder(tmp_path / "hf", source.state_dict())
    target = _net()
    gk.load(target, folder / "model.safetensors.index.json")
    assert _same_weights(target, source)


def test_sharded_bin_folder_loads_without_trust_when_it_holds_only_tensors(tmp_path: Path):
    source = _trained()
    folder = _hf_folder(tmp_path / "bin", source.state_dict(), safe_serialization=False)
    assert (folder / "pytorch_model.bin.index.json").exists()
    target = _net()
    assert gk.load(target, folder).format == "sharded torch"
    assert _same_weights(target, source)


class _Payload:
    """A pickled object whose loading would run code."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.getenv, ("HOME",))


def test_sharded_bin_folder_with_pickled_code_is_refused_without_trust(tmp_path: Path):
    folder = _hf_folder(tmp_path / "bin", _trained().state_dict(), safe_serialization=False)
    shard = sorted(folder.glob("pytorch_model-*.bin"))[0]
    state = torch.load(shard, weights_only=True)
    state["extra"] = _Payload()
    torch.save(state, shard)
    with pytest.raises(UntrustedCheckpointError, match="trust=True"):
        gk.load(_net(), folder)


def test_a_folder_with_one_unsharded_file_loads_that_file(tmp_path: Path):
    source = _trained()
    (tmp_path / "hf").mkdir()
    save_torch_state_dict(source.state_dict(), tmp_path / "hf")  # small: one model.safetensors
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    target = _net()
    assert gk.load(target, tmp_path / "hf").ok
    assert _same_weights(target, source)


def test_accelerate_save_model_folder_loads(tmp_path: Path):
    accelerate = pytest.importorskip(
        "accelerate", reason="accelerate is not installed (pip install 'gpukit[bench]')"
    )
    source = _trained()
    accelerate.Accelerator(cpu=True).save_model(source, tmp_path / "acc", max_shard_size="4KB")
    target = _net()
    assert gk.load(target, tmp_path / "acc").ok
    assert _same_weights(target, source)


def _accelerate_state(folder: Path, *, safe_serialization: bool) -> tuple[nn.Module, dict]:
    """Accelerator.save_state after one training step: the model, and the optimizer's state."""
    accelerate = pytest.importorskip(
        "accelerate", reason="accelerate is not installed (pip install 'gpukit[bench]')"
    )
    accelerator = accelerate.Accelerator(cpu=True)
    model = _trained()
    optimizer = torch.optim.Adam(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    scheduler.step()
    accelerator.save_state(str(folder), safe_serialization=safe_serialization)
    return accelerator.unwrap_model(model), optimizer.state_dict()


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "bin"])
def test_accelerate_save_state_folder_loads_the_model_with_optimizer_and_scheduler_in_extras(
    tmp_path: Path, safe_serialization: bool
):
    source, optimizer = _accelerate_state(tmp_path / "state", safe_serialization=safe_serialization)
    target = _net()
    report = gk.load(target, tmp_path / "state")
    assert report.ok
    assert _same_weights(target, source)
    assert report.container_key == "model"
    assert set(report.extras) == {"optimizer", "scheduler"}
    restored = report.extras["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(restored, optimizer["state"][0]["exp_avg"])
    assert report.extras["scheduler"]["last_epoch"] == 1
    # The random states hold numpy objects, which only a trusted pickle may rebuild.
    assert list(report.unread) == ["random_states_0"]
    assert "left unread: random_states_0" in str(report)
    assert "trust=True" in str(report)


def test_accelerate_save_state_random_states_are_read_with_trust(tmp_path: Path):
    _accelerate_state(tmp_path / "state", safe_serialization=True)
    report = gk.load(_net(), tmp_path / "state", trust=True)
    assert report.unread == {}
    assert set(report.extras) == {"optimizer", "scheduler", "random_states_0"}
    assert "torch_manual_seed" in report.extras["random_states_0"]


def test_torchtitan_checkpoint_with_the_model_at_the_top_level_loads_the_rest_into_extras(
    tmp_path: Path,
):
    # torchtitan's CheckpointManager flattens the model's entries into the top level.
    source = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(source.parameters())
    source(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = {**source.state_dict(), "optimizer": optimizer.state_dict(), "train_state": {"step": 3}}
    _dcp_save(state, tmp_path / "step-3")
    target = nn.Linear(4, 2)
    report = gk.load(target, tmp_path / "step-3")
    assert report.ok
    assert _same_weights(target, source)
    assert report.weights_at_top_level
    assert report.container_key is None
    assert set(report.extras) == {"optimizer", "train_state"}
    assert report.extras["train_state"] == {"step": 3}
    restored = report.extras["optimizer"]["state"]["0"]["exp_avg"]
    assert torch.equal(restored, optimizer.state_dict()["state"][0]["exp_avg"])
    assert "weights taken from the top-level tensors" in str(report)


def test_top_level_tensors_beside_two_state_dicts_are_still_refused_as_ambiguous(
    tmp_path: Path,
):
    student, teacher = _net().state_dict(), _net().state_dict()
    torch.save(
        {"student": student, "teacher": teacher, "temperature": torch.tensor(2.0)},
        tmp_path / "distill.pt",
    )
    with pytest.raises(CheckpointError, match=r"no model weights.*'student', 'teacher'"):
        gk.load(_net(), tmp_path / "distill.pt")


def test_dcp_folder_loads_into_the_model_without_a_process_group(tmp_path: Path):
    source = _trained()
    optimizer = torch.optim.Adam(source.parameters())
    source(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    state = {"model": source.state_dict(), "optim": optimizer.state_dict(), "epoch": 3}
    _dcp_save(state, tmp_path / "dcp")
    target = _net()
    report = gk.load(target, tmp_path / "dcp")
    assert report.ok
    assert report.format == "dcp"
    assert report.container_key == "model"
    assert _same_weights(target, source)
    assert not torch.distributed.is_initialized()
    assert report.extras["epoch"] == 3
    saved = optimizer.state_dict()
    # DCP stores nested keys as strings: the optimizer's state 0 comes back under "0".
    restored = report.extras["optim"]["state"]["0"]["exp_avg"]
    assert torch.equal(restored, saved["state"][0]["exp_avg"])
    assert report.extras["optim"]["param_groups"][0]["lr"] == saved["param_groups"][0]["lr"]


def test_dcp_entry_with_pickled_code_is_refused_without_trust_before_any_weight_loads(
    tmp_path: Path,
):
    source = _trained()
    _dcp_save({"model": source.state_dict(), "config": _Payload()}, tmp_path / "dcp")
    target = _net()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(UntrustedCheckpointError, match="trust=True"):
        gk.load(target, tmp_path / "dcp")
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    report = gk.load(target, tmp_path / "dcp", trust=True)
    assert report.extras["config"] == os.getenv("HOME")
    assert _same_weights(target, source)


def test_a_dcp_folder_read_into_a_state_fills_its_tensors_and_its_plain_entries(
    tmp_path: Path,
):
    source = _trained()
    _dcp_save({"model": source.state_dict(), "step": 3, "betas": [0.9, 0.99]}, tmp_path / "dcp")
    target = _net()
    state = {"model": target.state_dict(), "step": 0, "betas": None}
    open_dcp(tmp_path / "dcp").load(state)
    assert (state["step"], state["betas"]) == (3, [0.9, 0.99])
    assert _same_weights(target, source)  # read in place, into the model's own tensors


def test_a_dcp_entry_that_is_not_plain_data_is_refused_when_read_into_a_state(tmp_path: Path):
    _dcp_save({"model": _trained().state_dict(), "config": _Payload()}, tmp_path / "dcp")
    state = {"model": _net().state_dict(), "config": None}
    with pytest.raises(CheckpointError, match="the entry 'config' is not plain data"):
        open_dcp(tmp_path / "dcp").load(state)
    assert state["config"] is None


def test_a_dcp_folder_that_does_not_fit_the_state_is_refused_before_any_read(tmp_path: Path):
    _dcp_save({"model": _trained().state_dict()}, tmp_path / "dcp")
    wider = {"0.weight": torch.zeros(65, 32), "5.weight": torch.zeros(1)}
    with pytest.raises(CheckpointError, match=r"2 mismatches \(model.0.weight is \[64, 32\]"):
        open_dcp(tmp_path / "dcp").load({"model": wider})
    assert not wider["0.weight"].any()


def test_dcp_folder_of_a_wrapped_model_loads_into_the_plain_one(tmp_path: Path):
    source = _trained()
    keys = {
        f"_fsdp_wrapped_module._checkpoint_wrapped_module.{k}" if k.startswith("0.") else k: v
        for k, v in source.state_dict().items()
    }
    _dcp_save({"model": keys}, tmp_path / "dcp")
    target = _net()
    report = gk.load(target, tmp_path / "dcp")
    assert report.ok
    assert "_fsdp_wrapped_module." in report.prefixes_removed
    assert "_checkpoint_wrapped_module." in report.prefixes_removed
    assert _same_weights(target, source)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (Path.write_text, (str(self.marker), "ran"))  # type: ignore[return-value]


def test_dcp_metadata_that_names_other_code_is_refused_and_not_run(tmp_path: Path):
    _dcp_save({"model": _trained().state_dict()}, tmp_path / "dcp")
    marker = tmp_path / "ran.txt"
    metadata = tmp_path / "dcp" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CheckpointError, match="not plain DCP metadata"):
        gk.load(_net(), tmp_path / "dcp")
    assert not marker.exists()


def test_dcp_metadata_pointing_outside_the_folder_is_refused(tmp_path: Path):
    _dcp_save({"model": _trained().state_dict()}, tmp_path / "dcp")
    metadata_path = tmp_path / "dcp" / ".metadata"
    metadata = pickle.loads(metadata_path.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../secret.distcp"
    metadata_path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="not a data file in"):
        gk.load(_net(), tmp_path / "dcp")


def test_a_missing_dcp_data_file_is_named(tmp_path: Path):
    _dcp_save({"model": _trained().state_dict()}, tmp_path / "dcp")
    data = next((tmp_path / "dcp").glob("*.distcp"))
    data.unlink()
    with pytest.raises(CheckpointError, match=f"{data.name} is missing"):
        gk.load(_net(), tmp_path / "dcp")


def test_a_missing_shard_is_named_and_nothing_is_loaded(tmp_path: Path):
    folder = _hf_folder(tmp_path / "hf", _trained().state_dict())
    last = sorted(folder.glob("model-*.safetensors"))[-1]
    last.unlink()
    target = _net()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=f"{last.name} is missing"):
        gk.load(target, folder)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_a_truncated_shard_is_named(tmp_path: Path):
    folder = _hf_folder(tmp_path / "hf", _trained().state_dict())
    first = sorted(folder.glob("model-*.safetensors"))[0]
    first.write_bytes(first.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{first.name} .* cut short"):
        gk.load(_net(), folder)


def test_a_shard_that_does_not_match_the_index_names_both(tmp_path: Path):
    folder = _hf_folder(tmp_path / "hf", _trained().state_dict())
    shards = sorted(folder.glob("model-*.safetensors"))
    shards[0].write_bytes(shards[1].read_bytes())  # a shard of the same save, in the wrong place
    with pytest.raises(CheckpointError) as caught:
        gk.load(_net(), folder)
    assert shards[0].name in str(caught.value)
    assert "model.safetensors.index.json" in str(caught.value)


def test_an_index_that_points_outside_its_folder_is_refused(tmp_path: Path):
    folder = _hf_folder(tmp_path / "hf", _trained().state_dict())
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = "../elsewhere.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="not a file next to the index"):
        gk.load(_net(), folder)


def test_folder_save_writes_hugging_face_names_and_index(tmp_path: Path):
    source = _trained()
    out = gk.save(source, tmp_path / "weights", max_shard_size=4096)
    names = sorted(p.name for p in out.iterdir())
    count = len(names) - 1
    assert count > 1
    assert names == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)] + [
        "model.safetensors.index.json"
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    total = sum(t.numel() * t.element_size() for t in source.state_dict().values())
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(source.state_dict())
    for shard in out.glob("model-*.safetensors"):
        held = load_file(shard)
        stored = sum(t.numel() * t.element_size() for t in held.values())
        assert stored <= 4096 or len(held) == 1  # a tensor over the limit gets a shard of its own


def test_folder_save_is_read_by_hugging_face_loader(tmp_path: Path):
    source = _trained()
    gk.save(source, tmp_path / "weights", max_shard_size="4KB")
    target = _net()
    load_torch_model(target, tmp_path / "weights", strict=True)
    assert _same_weights(target, source)


def test_path_without_suffix_is_a_folder_and_loads_back(tmp_path: Path):
    source = _trained()
    out = gk.save(nn.DataParallel(source), tmp_path / "weights")
    assert (out / "model.safetensors.index.json").is_file()
    target = _net()
    assert gk.load(target, out).ok
    assert _same_weights(target, source)


def test_tied_weights_are_stored_once_in_a_folder_and_come_back_tied(tmp_path: Path):
    def tied() -> nn.Sequential:
        model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
        model[1].weight = model[0].weight
        return model

    source = tied()
    out = gk.save(source, tmp_path / "tied")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == ["0.weight"]
    target = tied()
    report = gk.load(target, out)
    assert report.ok
    assert target[1].weight is target[0].weight
    assert torch.equal(target[1].weight, source[0].weight)


def test_folder_save_replaces_an_earlier_save_as_a_whole(tmp_path: Path):
    out = tmp_path / "weights"
    gk.save(_net(), out, max_shard_size=2048)
    source = _trained()
    gk.save(source, out, max_shard_size=1 << 20)
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]  # nothing left beside it


def test_a_failed_folder_save_leaves_the_old_folder_whole(tmp_path: Path, monkeypatch):
    from gpukit.checkpoint import sharded

    out = tmp_path / "weights"
    old = _trained()
    gk.save(old, out, max_shard_size=2048)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []

    def failing(handle: object, tensors: object, metadata: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(handle, tensors, metadata)  # type: ignore[arg-type]

    real = sharded.write_safetensors
    monkeypatch.setattr(sharded, "write_safetensors", failing)
    with pytest.raises(OSError, match="No space"):
        gk.save(_net(), out, max_shard_size=2048)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]


def test_folder_save_refuses_to_replace_a_folder_with_other_files(tmp_path: Path):
    out = tmp_path / "project"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        gk.save(_net(), out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_single_file_save_onto_an_existing_folder_is_a_checkpoint_error(tmp_path: Path):
    (tmp_path / "m.pt").mkdir()
    with pytest.raises(CheckpointError, match="folder of that name exists"):
        gk.save(_net(), tmp_path / "m.pt")


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("2GB", 2 * 10**9),
        ("500MiB", 500 * 2**20),
        ("8 kib", 8192),
        (4096, 4096),
        ("1.5KB", 1500),
        ("9" * 400, int("9" * 400)),
    ],
)
def test_max_shard_size_reads_bytes_and_human_sizes(size: object, expected: int):
    from gpukit.sizes import parse_shard_size

    assert parse_shard_size(size) == expected


@pytest.mark.parametrize("size", ["2XB", "-1", 0, -5, True, 1.5, "", "GB", "nan"])
def test_max_shard_size_refuses_what_is_not_a_size(size: object, tmp_path: Path):
    with pytest.raises(InvalidArgumentError, match="max_shard_size"):
        gk.save(_net(), tmp_path / "w", max_shard_size=size)  # type: ignore[arg-type]
    assert not (tmp_path / "w").exists()


def test_torch_file_named_safetensors_loads_by_its_content(tmp_path: Path):
    source = _trained()
    torch.save(source.state_dict(), tmp_path / "model.safetensors")
    target = _net()
    assert gk.load(target, tmp_path / "model.safetensors").format == "torch"
    assert _same_weights(target, source)


def test_safetensors_file_named_pt_loads_by_its_content(tmp_path: Path):
    from safetensors.torch import save_file

    source = _trained()
    save_file(source.state_dict(), tmp_path / "model.pt")
    target = _net()
    assert gk.load(target, tmp_path / "model.pt").format == "safetensors"
    assert _same_weights(target, source)


_PEAK_SCRIPT = """
import sys, torch
from torch import nn
import gpukit as gk

def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])  # 64 MiB
gk.load(nn.Linear(1, 1), sys.argv[2])  # warm up: imports and first-use allocations
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS starts again from the current RSS
before = hwm_kib()
gk.load(model, sys.argv[1])
print(hwm_kib() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_loading_a_sharded_folder_grows_peak_memory_by_far_less_than_the_checkpoint(
    tmp_path: Path,
):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])
    folder = tmp_path / "sharded"
    folder.mkdir()
    save_torch_state_dict(model.state_dict(), folder, max_shard_size=8 * 2**20)
    assert len(list(folder.glob("*.safetensors"))) == 8
    gk.save(nn.Linear(1, 1), tmp_path / "tiny.safetensors")
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(folder), str(tmp_path / "tiny.safetensors")],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
        check=True,
    )
    grown_mib = int(result.stdout.strip()) / 1024
    assert grown_mib <= 32, f"peak RSS grew by {grown_mib:.1f} MiB loading 64 MiB of weights"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["sharded", "dcp"])
def test_a_folder_loads_straight_into_a_model_on_the_gpu(tmp_path: Path, layout: str):
    source = _trained()
    if layout == "sharded":
        gk.save(source, tmp_path / "ckpt", max_shard_size=4096)
    else:
        _dcp_save({"model": source.state_dict()}, tmp_path / "ckpt")
    target = _net().to("cuda")
    report = gk.load(target, tmp_path / "ckpt")
    assert report.ok
    assert report.device.startswith("cuda")
    assert all(t.device.type == "cuda" for t in target.state_dict().values())
    assert _same_weights(target.cpu(), source)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    limit=st.integers(1, 1200),
)
def test_any_state_dict_saved_in_shards_comes_back_equal_with_every_shard_within_the_limit(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], limit: int
):
    state = {
        f"layer{i}.weight": torch.arange(n, dtype=torch.float32) + i for i, n in enumerate(sizes)
    }
    out = gk.save(state, tmp_path_factory.mktemp("shards") / "w", max_shard_size=limit)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 4 * sum(sizes)
    for shard in set(index["weight_map"].values()):
        held = load_file(out / shard)
        assert sum(t.numel() * 4 for t in held.values()) <= limit or len(held) == 1
    shards = sorted(set(index["weight_map"].values()))
    loaded: dict[str, torch.Tensor] = {}
    for shard in shards:
        loaded.update(load_file(out / shard))
    assert sorted(loaded) == sorted(state)
    order = [index["weight_map"][key] for key in state]
    assert order == sorted(order)  # shards fill up key after key, in the state dict's order
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


_FSDP_SAVE = """
import gc, sys, torch, torch.distributed as dist
import torch.distributed.nn  # before the group: imported later, it keeps the group past exit
from torch import nn
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
fully_shard(model[0])
fully_shard(model)
optimizer = torch.optim.Adam(model.parameters())
model(torch.randn(2, 8)).sum().backward()
optimizer.step()
dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=sys.argv[1])
torch.save({k: v.full_tensor() for k, v in model.state_dict().items()}, sys.argv[1] + ".pt")
# Nothing may hold the group once it is destroyed, or gloo's threads abort the exit.
del model, optimizer
gc.collect()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_dcp_folder_written_by_fsdp2_under_a_gloo_group_loads_on_one_process(tmp_path: Path):
    subprocess.run(
        [sys.executable, "-c", _FSDP_SAVE, str(tmp_path / "fsdp"), str(tmp_path / "rendezvous")],
        env=subprocess_env(),
        check=True,
        timeout=300,
        capture_output=True,
    )
    target = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    report = gk.load(target, tmp_path / "fsdp")
    assert report.ok
    assert set(report.extras) == {"optim"}
    # Where there is a GPU, FSDP put the model, and so the saved full tensors, on it.
    expected = torch.load(tmp_path / "fsdp.pt", weights_only=True, map_location="cpu")
    assert all(torch.equal(expected[k], v) for k, v in target.state_dict().items())
