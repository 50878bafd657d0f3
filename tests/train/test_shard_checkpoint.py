"""gk.save and gk.load of a model sharded over two processes (FSDP2 on gloo), and four.

The test process is rank 0 of a real two-process group (``tests/helpers/two_processes.py``).
Each save is of the model every rank has moved by +1 (``bumped``), so a load that did nothing,
or loaded a fresh model, is told apart from one that loaded the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import gpukit as gk
from gpukit import distributed as gkdist
from gpukit.checkpoint import sharded_model
from gpukit.checkpoint.dcp import open_dcp
from gpukit.checkpoint.digests import digest
from gpukit.errors import CheckpointError
from gpukit.train import saves
from tests.helpers.two_processes import OtherRank, two_processes
from tests.train import shard_workloads as work

# Its workers train on the CPU with gloo, on a GPU machine too.
pytestmark = [pytest.mark.slow, pytest.mark.cpu_workers]


@pytest.fixture(scope="module")
def expected() -> dict[str, list[float]]:
    """The full weights every save below holds."""
    return work.full_weights(work.bumped(work.model()))


@pytest.fixture(scope="module")
def other_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as other:
        yield other


def _both(other: OtherRank, fn: object, *args: object) -> tuple[object, object]:
    other.run(fn, *args)  # type: ignore[arg-type]
    mine = fn(0, *args)  # type: ignore[operator]
    return mine, other.result()


@pytest.fixture(scope="module")
def dcp_folder(other_rank: OtherRank, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP folder saved by the two sharded processes."""
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    _both(other_rank, work.save_sharded, str(path))
    return path


def test_a_sharded_save_is_a_dcp_folder_where_each_rank_wrote_only_its_own_part(
    dcp_folder: Path,
) -> None:
    stored = open_dcp(dcp_folder).checked.storage_data
    chunks = {(i.fqn, tuple(i.offset)): info.relative_path for i, info in stored.items()}
    # 7 rows split 4 + 3: rank 0 wrote rows 0-3 of each weight, rank 1 rows 4-6, nobody all.
    assert chunks[("blocks.0.linear.weight", (0, 0))] == "__0_0.distcp"
    assert chunks[("blocks.0.linear.weight", (4, 0))] == "__1_0.distcp"
    files = sorted(chunks.values())
    assert files == ["__0_0.distcp"] * 10 + ["__1_0.distcp"] * 10  # one chunk per tensor each
    assert sorted(p.name for p in dcp_folder.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]


def test_a_dcp_folder_saved_sharded_loads_into_one_unsharded_process(
    dcp_folder: Path, expected: dict[str, list[float]]
) -> None:
    net = work.model()
    report = gk.load(net, dcp_folder)
    assert report.ok
    assert report.format == "dcp"
    assert work.full_weights(net) == expected


def test_a_dcp_folder_loads_back_into_the_model_sharded_over_the_same_processes(
    other_rank: OtherRank, dcp_folder: Path, expected: dict[str, list[float]]
) -> None:
    mine, theirs = _both(other_rank, work.load_sharded, str(dcp_folder))
    assert mine == expected
    assert theirs == expected


def test_full_weights_export_as_a_hugging_face_folder_that_safetensors_reads(
    other_rank: OtherRank, tmp_path: Path, expected: dict[str, list[float]]
) -> None:
    folder = tmp_path / "weights"
    _both(other_rank, work.save_sharded, str(folder), "1KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected)
    assert len(set(index["weight_map"].values())) == 2  # 1688 bytes in shards of 1 KB
    read: dict[str, list[float]] = {}
    for name in set(index["weight_map"].values()):
        read.update({k: v.flatten().tolist() for k, v in load_file(folder / name).items()})
    assert read == expected


def test_an_exported_folder_loads_into_a_model_sharded_over_the_processes(
    other_rank: OtherRank, tmp_path: Path, expected: dict[str, list[float]]
) -> None:
    folder = tmp_path / "weights"
    _both(other_rank, work.save_sharded, str(folder), "1KB")
    mine, theirs = _both(other_rank, work.load_sharded, str(folder))
    assert mine == expected
    assert theirs == expected


def test_a_one_file_save_of_a_sharded_model_holds_the_full_weights(
    other_rank: OtherRank, tmp_path: Path, expected: dict[str, list[float]]
) -> None:
    path = tmp_path / "model.safetensors"
    _both(other_rank, work.save_sharded, str(path))
    net = work.model()
    gk.load(net, path)
    assert work.full_weights(net) == expected


def test_a_file_saved_by_one_unsharded_process_loads_into_a_sharded_model(
    other_rank: OtherRank, tmp_path: Path, expected: dict[str, list[float]]
) -> None:
    path = gk.save(torch.nn.DataParallel(work.bumped(work.model())), tmp_path / "one.pt")
    mine, theirs = _both(other_rank, work.load_sharded, str(path))
    assert mine == expected
    assert theirs == expected


def test_a_model_sharded_by_torch_itself_saves_on_every_rank_too(
    other_rank: OtherRank, tmp_path: Path, expected: dict[str, list[float]]
) -> None:
    # Its ranks first meet in a group made at this first save, not when gpukit sharded it.
    path = tmp_path / "ckpt"
    _both(other_rank, work.save_sharded_by_torch, str(path))
    net = work.model()
    assert gk.load(net, path).ok
    assert work.full_weights(net) == expected


def test_a_training_state_saved_sharded_gives_one_process_its_weights(
    other_rank: OtherRank, tmp_path: Path
) -> None:
    path = tmp_path / "state"
    _both(other_rank, work.save_training_state, str(path))
    report = gk.load(work.model(), path)
    assert report.ok
    assert report.container_key == "model"
    assert report.extras["step"] == 1
    assert set(report.extras["optimizer"]["state"]) == {
        n for n, _ in work.model().named_parameters()
    }


def test_a_checkpoint_of_another_shape_is_refused_on_every_rank_before_loading(
    other_rank: OtherRank, dcp_folder: Path
) -> None:
    mine, theirs = _both(other_rank, work.load_error, str(dcp_folder))
    assert str(mine).startswith("CheckpointError:")
    assert "does not fit Stack: 9 shape mismatches" in str(mine)
    assert theirs == mine


@pytest.mark.parametrize("max_shard_size", [None, "1KB"], ids=["dcp", "full weights"])
def test_a_sharded_save_into_a_folder_of_other_files_is_refused_on_every_rank(
    other_rank: OtherRank, tmp_path: Path, max_shard_size: str | None
) -> None:
    # With full weights, the other rank already waits to gather tensors with rank 0: rank 0
    # joins those gathers before the error reaches both, so neither hangs.
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "README.md").write_text("mine")
    mine, theirs = _both(other_rank, work.save_error, str(folder), max_shard_size)
    assert "holds other files (README.md)" in str(mine)
    assert theirs == mine
    assert sorted(os.listdir(folder)) == ["README.md"]
    assert sorted(os.listdir(tmp_path)) == ["notes"]  # no temporary folder left behind


def test_a_dcp_save_that_fails_on_one_rank_raises_one_typed_error_on_every_rank(
    other_rank: OtherRank, tmp_path: Path
) -> None:
    # gk.save writes its DCP folder as the training state writes its sharded part: through
    # one writer, whose failure on any rank is the same CheckpointError on every rank.
    path = tmp_path / "ckpt"
    mine, theirs = _both(other_rank, work.gk_save_failing_on_rank_1, str(path))
    assert str(mine).startswith(f"CheckpointError: Cannot write the DCP checkpoint {path}: ")
    assert "No space left on device" in str(mine)
    assert theirs == mine
    assert os.listdir(tmp_path) == []  # no folder, no temporary folder


@pytest.fixture
def rank_0_alone(other_rank: OtherRank, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """A model sharded over both ranks, after which rank 1 goes on alone: the unsharded habit
    ``if dist.is_main(): gk.save(model, ...)``. Rank 0 waits 2 s for rank 1 to join."""
    monkeypatch.setattr(sharded_model, "JOIN_TIMEOUT", timedelta(seconds=2))
    other_rank.run(work.sharded_only)
    net = gkdist.prepare(work.model(), shard=True)
    assert other_rank.result() == "sharded"
    return net


def test_a_sharded_save_on_rank_0_alone_fails_fast_saying_to_call_it_on_every_rank(
    rank_0_alone: torch.nn.Module, tmp_path: Path
) -> None:
    started = time.monotonic()
    with pytest.raises(CheckpointError) as caught:
        gk.save(rank_0_alone, tmp_path / "model.pt")
    assert time.monotonic() - started < 30  # not the group's timeout, nor a crash
    assert "gk.save of a sharded model was not called by every rank" in str(caught.value)
    assert "Call gk.save(model, path) on every rank with a sharded model (it writes once)" in (
        caught.value.hint or ""
    )
    assert os.listdir(tmp_path) == []


def test_a_sharded_load_on_rank_0_alone_fails_fast_saying_to_call_it_on_every_rank(
    rank_0_alone: torch.nn.Module, dcp_folder: Path
) -> None:
    # Each rank reads its own part of a DCP folder: alone, rank 0 would load only its rows.
    with pytest.raises(CheckpointError) as caught:
        gk.load(rank_0_alone, dcp_folder)
    assert "Call gk.load(model, path) on every rank with a sharded model" in (
        caught.value.hint or ""
    )


@pytest.fixture(scope="module")
def saved_state(other_rank: OtherRank, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A training state two sharded processes saved after STOP steps, and what they saw."""
    folder = tmp_path_factory.mktemp("state") / "run"
    mine, theirs = _both(other_rank, work.run_with_state, str(folder), work.STOP)
    (save,) = folder.iterdir()
    return {"folder": folder, "save": save, "ranks": [mine, theirs]}


def _copy(save: Path, tmp_path: Path) -> Path:
    """A copy of one save, alone in a run folder of its own (so a test may damage it)."""
    run = tmp_path / "run"
    shutil.copytree(save, run / save.name)
    return run / save.name


def _tensor_elements(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, dict):
        return sum(_tensor_elements(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_elements(v) for v in value)
    return 0


def _tensor_bytes_per_file(folder: Path) -> dict[str, int]:
    """The bytes of tensor data each file of a DCP folder holds, as its .metadata says."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    checked = open_dcp(folder).checked
    found: dict[str, int] = {}
    for key, entry in checked.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        for chunk in entry.chunks:
            name = checked.storage_data[MetadataIndex(key, chunk.offsets)].relative_path
            size = entry.properties.dtype.itemsize * torch.Size(chunk.sizes).numel()
            found[name] = found.get(name, 0) + size
    return found


def test_each_rank_of_a_sharded_training_state_writes_only_its_own_shards(
    saved_state: dict[str, Any],
) -> None:
    save = saved_state["save"]
    sharded = save / "sharded"
    assert sorted(p.name for p in sharded.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    stored = open_dcp(sharded).checked.storage_data
    chunks = {
        (i.fqn, tuple(i.offset)): info.relative_path
        for i, info in stored.items()
        if i.offset is not None  # a tensor's chunk, not a pickled entry
    }
    # 7 rows split 4 + 3, the weights and AdamW's moments alike: each rank wrote its own rows.
    for key in ("model.blocks.0.linear.weight", "optimizer.state.blocks.0.linear.weight.exp_avg"):
        assert chunks[(key, (0, 0))] == "__0_0.distcp"
        assert chunks[(key, (4, 0))] == "__1_0.distcp"
    per_file = _tensor_bytes_per_file(sharded)
    whole = 3 * 8 * sum(p.numel() for p in work.model().parameters())  # weights, 2 moments
    assert sum(per_file.values()) >= whole
    # Rank 0 holds 4 of 7 rows (and the 1-row head): no rank's file holds the whole state.
    assert max(per_file.values()) < 0.7 * whole
    shared = torch.load(save / "shared.pt", weights_only=True)
    assert "model" not in shared
    assert "optimizer" not in shared
    assert _tensor_elements(shared) < 8  # counters only, no weights
    marker = json.loads((save / "COMPLETE.json").read_text())
    assert {n for n in marker["files"] if n.startswith("sharded/")} == {
        f"sharded/{name}" for name in (".metadata", "__0_0.distcp", "__1_0.distcp")
    }


def test_every_rank_fsyncs_its_shards_before_rank_0_marks_the_save_complete(
    saved_state: dict[str, Any],
) -> None:
    mine, theirs = saved_state["ranks"]
    marked = min(when for when, path in mine["fsyncs"] if "COMPLETE.json" in path)
    assert not any("COMPLETE.json" in path for _, path in theirs["fsyncs"])
    before = {
        Path(path).name: rank
        for rank, found in enumerate((mine, theirs))
        for when, path in found["fsyncs"]
        if when < marked and "/sharded/" in path
    }
    # Each rank its own shards; rank 0, DCP's coordinator, the metadata (renamed in after).
    assert before == {"__0_0.distcp": 0, "__1_0.distcp": 1, ".metadata.tmp": 0}


def test_no_rank_makes_a_tensor_as_large_as_a_whole_weight_while_it_saves(
    saved_state: dict[str, Any],
) -> None:
    # A block's weight is 7 x 7: rank 0 holds 4 rows of it (28 elements), rank 1 3 rows (21),
    # and copies them to host memory while it saves. Gathering a weight, or the whole model,
    # on a rank makes a tensor of 49 elements or more.
    assert [rank["largest"] for rank in saved_state["ranks"]] == [28, 21]


def test_a_sharded_run_resumed_on_the_same_processes_ends_bitwise_as_the_whole_run(
    other_rank: OtherRank, saved_state: dict[str, Any], tmp_path: Path
) -> None:
    whole = _both(other_rank, work.train)
    run = _copy(saved_state["save"], tmp_path).parent
    mine, theirs = _both(other_rank, work.run_with_state, str(run))
    assert mine["weights"] == whole[0]  # type: ignore[index]
    assert theirs["weights"] == whole[0]  # type: ignore[index]


def test_the_shards_an_asynchronous_save_writes_are_those_of_the_step_it_was_called_at(
    other_rank: OtherRank, tmp_path: Path
) -> None:
    mine, theirs = _both(other_rank, work.change_after_saving, str(tmp_path / "run"))
    assert mine["resumed"] == mine["at_save"]  # type: ignore[index]
    assert theirs["resumed"] == theirs["at_save"]  # type: ignore[index]


def test_a_sharded_save_that_fails_on_one_rank_fails_on_every_rank_and_leaves_nothing(
    other_rank: OtherRank, tmp_path: Path
) -> None:
    folder = tmp_path / "run"
    mine, theirs = _both(other_rank, work.save_failing_on_rank_1, str(folder))
    assert str(mine).startswith("CheckpointError: Cannot write the DCP checkpoint")
    assert "No space left on device" in str(theirs)
    assert list(folder.iterdir()) == []  # the half-written save was removed


def test_a_save_whose_shard_file_is_cut_short_or_missing_is_passed_over(
    saved_state: dict[str, Any], tmp_path: Path
) -> None:
    save = _copy(saved_state["save"], tmp_path)
    data = save / "sharded" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])
    found, passed = saves.newest(save.parent)
    assert found is None
    assert "sharded/__1_0.distcp has" in passed[0]
    data.unlink()
    assert "sharded/__1_0.distcp is missing" in saves.newest(save.parent)[1][0]


def test_a_save_whose_shard_metadata_is_damaged_is_refused_on_every_rank(
    other_rank: OtherRank, saved_state: dict[str, Any], tmp_path: Path
) -> None:
    save = _copy(saved_state["save"], tmp_path)
    metadata = save / "sharded" / ".metadata"
    hostile = b"\x80\x04cos\nsystem\n"  # a pickle that names os.system, the same size
    metadata.write_bytes(hostile + b"\0" * (metadata.stat().st_size - len(hostile)))
    # Its digest rewritten too (by whoever can write the save): the reader must refuse it still.
    marker = json.loads((save / saves.MARKER).read_text())
    marker["digests"]["sharded/.metadata"] = digest(metadata)
    (save / saves.MARKER).write_text(json.dumps(marker))
    mine, theirs = _both(other_rank, work.resume_error, str(save.parent))
    assert str(mine).startswith("CheckpointError: ")
    assert "is not plain DCP metadata: refused global os.system" in str(mine)
    assert theirs == mine


def test_four_processes_load_a_folder_and_resume_states_others_saved(
    dcp_folder: Path, saved_state: dict[str, Any], expected: dict[str, list[float]]
) -> None:
    # A DCP folder resharded from two processes to four, and two runs resumed sharded over
    # four: one two sharded processes saved (DCP resharded), one a single unsharded process
    # saved (its whole state, each rank keeping its rows). One process, unsharded, also
    # finishes the run two sharded processes saved. (Four processes training as one:
    # tests/train/test_shard_exact.py.)
    found = work.in_four_processes("checkpoint", str(dcp_folder), str(saved_state["folder"]))
    single, ranks = found["single"], found["ranks"]
    assert _furthest(found["one"], single) <= 1e-12
    assert len(ranks) == 4
    for rank in ranks:
        assert rank["loaded"] == expected
        assert _furthest(rank["from_two"], single) <= 1e-12
        assert _furthest(rank["from_one"], single) <= 1e-12


def _furthest(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for key in a for x, y in zip(a[key], b[key], strict=True))
