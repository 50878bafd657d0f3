"""Saves are atomic: a crash or a kill at any moment leaves the old file or the new one, whole."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

import gpukit as gk
from gpukit.checkpoint.atomic import TMP_SUFFIX

_ELEMENTS = 1_000_000  # 4 MB: a save takes long enough for kills to land inside it


def _temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.endswith(TMP_SUFFIX)]


def _save_forever(target: str, first: int, conn: Connection) -> None:
    torch.set_num_threads(1)  # a forked child must not use the parent's thread pool
    weights = torch.empty(_ELEMENTS)
    conn.send("started")
    generation = first
    while True:
        weights.fill_(float(generation))
        gk.save({"generation": torch.tensor(generation), "w": weights}, target)
        conn.send(generation)
        generation += 1


def _drain(receiver: Connection) -> list[int]:
    """The generations the child reported as fully saved before it died."""
    finished = []
    while receiver.poll():
        try:
            finished.append(receiver.recv())
        except EOFError:  # a report cut short by the kill
            break
    return finished


def _generation_in(path: Path) -> int:
    state = torch.load(path, weights_only=True)
    weights = state["w"]
    generation = int(state["generation"])
    # Whole: every byte of the tensor comes from the same save as its header.
    assert float(weights.min()) == float(weights.max()) == float(generation)
    return generation


def _kill_saves_at_random_moments(
    tmp_path: Path,
    target: Path,
    save_forever: Callable[..., None],
    generation_in: Callable[[Path], int],
    seed: int,
    longest_pause: float,
) -> None:
    """Kill a child saving ``target`` over and over at 25 random moments; after each kill the
    target must hold the last save the child finished or the one it was writing, whole."""
    on_disk = 0
    context = multiprocessing.get_context("fork")
    rng = random.Random(seed)
    kills_mid_write = 0
    for round_ in range(1, 26):
        receiver, sender = context.Pipe(duplex=False)
        first = round_ * 10_000  # exact in float32
        child = context.Process(target=save_forever, args=(str(target), first, sender))
        child.start()
        assert receiver.recv() == "started"
        time.sleep(rng.uniform(0.0, longest_pause))
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join()
        finished = _drain(receiver)
        leftovers = _temporaries(tmp_path)
        kills_mid_write += bool(leftovers)
        assert len(leftovers) <= 1  # each save clears what dead savers left
        last_done = finished[-1] if finished else on_disk
        next_one = finished[-1] + 1 if finished else first
        on_disk = generation_in(target)
        assert on_disk in (last_done, next_one)
    assert kills_mid_write > 0  # the kills did land inside saves


@pytest.mark.slow
def test_killing_a_save_at_random_moments_leaves_the_old_or_the_new_file_whole(tmp_path: Path):
    target = tmp_path / "ckpt.pt"
    gk.save({"generation": torch.tensor(0), "w": torch.zeros(_ELEMENTS)}, target)
    _kill_saves_at_random_moments(tmp_path, target, _save_forever, _generation_in, 1234, 0.12)
    gk.save({"generation": torch.tensor(-1), "w": torch.full((_ELEMENTS,), -1.0)}, target)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


class _Unpicklable:
    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("cannot pickle this")


def test_failed_save_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path):
    target = tmp_path / "m.pt"
    gk.save({"w": torch.ones(3)}, target)
    with pytest.raises(RuntimeError, match="cannot pickle"):
        gk.save({"w": torch.zeros(3), "bad": _Unpicklable()}, target)
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(3))
    assert _temporaries(tmp_path) == []


def test_next_save_removes_temporaries_of_dead_savers_only(tmp_path: Path):
    target = tmp_path / "m.safetensors"
    dead = _pid_of_finished_process()
    stale = tmp_path / f".m.safetensors.{dead}.0badc0de{TMP_SUFFIX}"
    live = tmp_path / f".m.safetensors.{os.getpid()}.0badc0de{TMP_SUFFIX}"
    other = tmp_path / f".other.pt.{dead}.0badc0de{TMP_SUFFIX}"
    for path in (stale, live, other):
        path.write_bytes(b"partial")
    gk.save({"w": torch.ones(2)}, target)
    assert not stale.exists()
    assert live.exists()  # a save in progress elsewhere is left alone
    assert other.exists()  # another target's temporaries are not this save's business


def _pid_of_finished_process() -> int:
    process = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    process.start()
    process.join()
    assert process.pid is not None
    return process.pid


_PARTS = 4  # the folder's weights: four 1 MB tensors, one shard each


def _save_folder_forever(target: str, first: int, conn: Connection) -> None:
    torch.set_num_threads(1)
    parts = [torch.empty(_ELEMENTS // _PARTS) for _ in range(_PARTS)]
    conn.send("started")
    generation = first
    while True:
        for part in parts:
            part.fill_(float(generation))
        state = {f"w{i}": part for i, part in enumerate(parts)}
        gk.save(state, target, max_shard_size=_ELEMENTS)  # 4 MB limit: a shard per tensor
        conn.send(generation)
        generation += 1


def _generation_in_folder(folder: Path) -> int:
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert sorted(p.name for p in folder.iterdir()) == [*shards, "model.safetensors.index.json"]
    values = {float(t.min()) for s in shards for t in load_file(folder / s).values()}
    values |= {float(t.max()) for s in shards for t in load_file(folder / s).values()}
    assert len(values) == 1  # every shard of the folder comes from the same save
    return int(values.pop())


@pytest.mark.slow
def test_killing_a_folder_save_at_random_moments_leaves_the_old_or_the_new_folder_whole(
    tmp_path: Path,
):
    target = tmp_path / "weights"
    gk.save({f"w{i}": torch.zeros(_ELEMENTS // _PARTS) for i in range(_PARTS)}, target)
    _kill_saves_at_random_moments(
        tmp_path, target, _save_folder_forever, _generation_in_folder, 4321, 0.15
    )
    gk.save({"w0": torch.ones(2)}, target)
    assert [p.name for p in tmp_path.iterdir()] == ["weights"]
