"""gk.save and gk.load of a model sharded over two processes (FSDP2 on gloo), and four.

The test process is rank 0 of a real two-process group (``tests/helpers/two_processes.py``).
Each save is of the model every rank has moved by +1 (``bumped``), so a load that did nothing,
or loaded a fresh model, is told apart from one that loaded the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import gpukit as gk
from gpukit.checkpoint.dcp import open_dcp
from tests.helpers.two_processes import OtherRank, two_processes
from tests.train import shard_workloads as work

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


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


def test_four_processes_train_as_one_and_load_a_folder_two_processes_saved(
    dcp_folder: Path, expected: dict[str, list[float]]
) -> None:
    # The one four-process run of the suite: exact training with 97 samples (the last step
    # gives three ranks no sample) and a DCP folder resharded from two processes to four.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/train/shard_four.py"), str(dcp_folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    single, ranks = found["single"], found["ranks"]
    assert len(ranks) == 4
    for rank in ranks:
        assert rank["loaded"] == expected
        furthest = max(
            abs(a - b)
            for key in single
            for a, b in zip(rank["weights"][key], single[key], strict=True)
        )
        assert furthest <= 1e-12
