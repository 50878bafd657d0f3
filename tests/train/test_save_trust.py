"""The training state's save folder against co-users, strangers' saves and accidents.

The trust model (a save resumed only from this user or root, a folder others can write refused,
old saves pruned only when they are this user's), the digests of every file, and each part of a
save checked by structure before its loader sees it. Acting as another user needs root (files
are given to another uid with ``chown``, or a child process drops to ``nobody``); those tests
skip without it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from gpukit.checkpoint.digests import digest
from gpukit.errors import CheckpointError, GpukitError, InvalidArgumentError
from gpukit.train import TrainingState, saves
from tests.helpers.other_user import as_nobody

OTHER = 54321  # a uid with no account: another user of the machine
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3, dtype=torch.float64)).square().mean().backward()  # type: ignore[no-untyped-call]
        opt.step()
        sched.step()
    return model, opt, sched


def _save(folder: Path, steps: list[int], seed: int = 0, keep: int = 10) -> list[Path]:
    """Saves of a trained model, optimizer and scheduler at ``steps``; their folders."""
    model, opt, sched = _trained(seed)
    made = []
    with TrainingState(
        folder, model=model, optimizer=opt, scheduler=sched, keep=keep, asynchronous=False
    ) as state:
        for step in steps:
            state.step = step
            with torch.no_grad():
                model[0].bias.fill_(step)
            made.append(state.save())
    return made


def _resume(folder: Path, seed: int = 7) -> tuple[Any, nn.Module]:
    model, opt, sched = _trained(seed)
    with TrainingState(folder, model=model, optimizer=opt, scheduler=sched) as state:
        return state.resume(), model


def _rewrite(save: Path, name: str, content: object | bytes) -> None:
    """Replace one file of a save and make its marker agree (size, and digest): a save as
    someone with write access, or another version of the script, could have written it."""
    data = content if isinstance(content, bytes) else _torch_bytes(content)
    (save / name).write_bytes(data)
    marker = json.loads((save / saves.MARKER).read_text())
    marker["files"][name] = len(data)
    if "digests" in marker:
        marker["digests"][name] = digest(save / name)
    (save / saves.MARKER).write_text(json.dumps(marker))


def _torch_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _load(save: Path, name: str) -> Any:
    return torch.load(save / name, weights_only=True)


def _chown_tree(path: Path, uid: int) -> None:
    for root, folders, files in os.walk(path):
        for name in [*folders, *files]:
            os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)
    os.chown(path, uid, uid)


# --- the trust model -------------------------------------------------------------------------


@needs_root
def test_a_genuine_save_a_co_user_planted_at_a_high_step_is_passed_over(tmp_path: Path) -> None:
    shared = tmp_path / "scratch"  # a team scratch folder, shared as /tmp is
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    run = shared / "run"
    mine = _save(run, [5])[0]
    (hers,) = _save(tmp_path / "hers", [999999], seed=3)
    _chown_tree(hers, OTHER)
    planted = run / hers.name
    shutil.move(hers, planted)
    run.chmod(0o1777)  # she could write into it
    resumed, model = _resume(run)
    assert resumed is not None
    assert resumed.path == mine
    assert any(
        line.startswith(planted.name) and "belongs to uid 54321" in line
        for line in resumed.passed_over
    )
    assert torch.equal(model[0].bias, torch.full((4,), 5.0, dtype=torch.float64))


@needs_root
def test_a_save_folder_squatted_by_a_co_user_is_refused_for_saving_and_resuming(
    tmp_path: Path,
) -> None:
    squatted = tmp_path / "run"
    _save(squatted, [999999], seed=3)
    _chown_tree(squatted, OTHER)
    model = _model()
    with TrainingState(squatted, model=model, asynchronous=False) as state:
        with pytest.raises(CheckpointError, match="belongs to uid 54321") as resumed:
            state.resume()
        assert "Save into a folder of your own" in (resumed.value.hint or "")
        with pytest.raises(CheckpointError, match="belongs to uid 54321"):
            state.save()
    assert sorted(p.name for p in squatted.iterdir()) == [
        p.name for p in squatted.iterdir() if p.name.startswith("step-000999999")
    ]


def test_a_save_folder_anyone_can_write_without_the_sticky_bit_is_refused(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    _save(run, [5])
    run.chmod(0o777)
    with pytest.raises(CheckpointError, match="anyone on this machine can write it") as refused:
        _resume(run)
    assert "chmod o-w" in (refused.value.hint or "")
    with TrainingState(run, model=_model()) as state, pytest.raises(CheckpointError):
        state.save()
    run.chmod(0o1777)  # shared as /tmp is: accepted
    resumed, _ = _resume(run)
    assert resumed is not None


def test_a_save_folder_its_group_can_write_is_accepted_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    _save(run, [5])
    run.chmod(0o775)
    with caplog.at_level(logging.WARNING, logger="gpukit.train"):
        resumed, _ = _resume(run)
    assert resumed is not None
    assert any("can be written by its group" in r.getMessage() for r in caplog.records)


@needs_root
def test_a_link_to_the_save_folder_made_by_a_co_user_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "mine"
    _save(target, [5])
    link = tmp_path / "link"
    link.symlink_to(target)
    os.chown(link, OTHER, OTHER, follow_symlinks=False)
    with pytest.raises(CheckpointError, match="the link belongs to uid 54321"):
        _resume(link)


def test_a_link_to_a_save_folder_the_user_made_is_followed(tmp_path: Path) -> None:
    target = tmp_path / "scratch"
    made = _save(target, [5])
    link = tmp_path / "checkpoints"
    link.symlink_to(target)
    resumed, _ = _resume(link)
    assert resumed is not None
    assert resumed.path.name == made[0].name


@needs_root
def test_saves_a_co_user_left_in_the_folder_are_never_pruned_and_never_fail_a_save(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o1777)
    run.chmod(0o1777)
    junk = run / "step-000000001-abcdef-0"
    junk.mkdir()
    (junk / "her-file").write_bytes(b"x")
    (old,) = _save(tmp_path / "hers", [2], seed=3)
    _chown_tree(old, OTHER)
    shutil.move(old, run / old.name)
    _chown_tree(junk, OTHER)
    made = _save(run, [3, 4, 5], keep=1)
    assert junk.exists()
    assert (run / old.name).exists()
    assert [p.exists() for p in made] == [False, False, True]


@pytest.fixture
def nobodys_home() -> Iterator[Path]:
    """A folder of nobody's, reachable by nobody (pytest's own folders are root's, 0700)."""
    home = Path(tempfile.mkdtemp(prefix="gpukit-nobody-"))
    try:
        os.chown(home, NOBODY, NOBODY)
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


@needs_root
def test_an_old_save_written_under_sudo_does_not_make_later_saves_fail(
    nobodys_home: Path,
) -> None:
    run = nobodys_home / "run"
    _save(run, [1])  # root's, as a run under sudo leaves it
    os.chown(run, NOBODY, NOBODY)
    outcomes = []
    for asynchronous in (False, True):

        def save_twice(asynchronous: bool = asynchronous) -> None:
            model = _model()
            with TrainingState(run, model=model, keep=1, asynchronous=asynchronous) as state:
                for step in (2, 3):
                    state.step = step
                    state.save()
                state.wait()

        outcomes.append(as_nobody(save_twice)[0])
    assert outcomes == ["ok", "ok"]
    markers = [json.loads((p / saves.MARKER).read_text()) for p in sorted(run.iterdir())]
    assert sorted(m["step"] for m in markers) == [1, 3]  # root's kept, and nobody's newest


# --- digests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [saves.SHARED, saves.rank_file(0)])
@pytest.mark.parametrize("where", [0.0, 0.5, 0.999])
def test_a_byte_changed_in_place_in_any_file_passes_the_save_over_to_the_intact_one(
    tmp_path: Path, name: str, where: float
) -> None:
    older, newer = _save(tmp_path, [5, 10])
    path = newer / name
    data = bytearray(path.read_bytes())
    data[int(where * (len(data) - 1))] ^= 0x01
    path.write_bytes(bytes(data))  # same size: the marker's sizes still agree
    resumed, model = _resume(tmp_path)
    assert resumed is not None
    assert resumed.path == older
    assert any(name in line and "digest" in line for line in resumed.passed_over)
    assert torch.equal(model[0].bias, torch.full((4,), 5.0, dtype=torch.float64))


def test_every_file_of_a_save_has_a_digest_in_its_marker(tmp_path: Path) -> None:
    (save,) = _save(tmp_path, [5])
    marker = json.loads((save / saves.MARKER).read_text())
    assert set(marker["digests"]) == set(marker["files"]) == {saves.SHARED, saves.rank_file(0)}
    for name, value in marker["digests"].items():
        assert value == digest(save / name)


def test_the_digest_is_xxh3_128_of_the_content(tmp_path: Path) -> None:
    import xxhash

    path = tmp_path / "f"
    for content in (b"", b"a", os.urandom(1 << 20)):
        path.write_bytes(content)
        assert digest(path) == xxhash.xxh3_128_hexdigest(content)


def test_a_marker_with_a_malformed_digest_is_passed_over(tmp_path: Path) -> None:
    older, newer = _save(tmp_path, [5, 10])
    marker = json.loads((newer / saves.MARKER).read_text())
    marker["digests"][saves.SHARED] = "Z" * 32
    (newer / saves.MARKER).write_text(json.dumps(marker))
    resumed, _ = _resume(tmp_path)
    assert resumed is not None
    assert resumed.path == older
    assert "one digest for each file" in resumed.passed_over[0]


def test_a_damaged_newest_save_with_no_intact_one_resumes_nothing_and_says_why(
    tmp_path: Path,
) -> None:
    (only,) = _save(tmp_path, [5])
    data = bytearray((only / saves.SHARED).read_bytes())
    data[100] ^= 0xFF
    (only / saves.SHARED).write_bytes(bytes(data))
    resumed, _ = _resume(tmp_path)
    assert resumed is None


# --- bounds on what the marker and the names say ---------------------------------------------


def test_a_tiny_marker_claiming_a_million_ranks_is_refused_before_naming_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    older, newer = _save(tmp_path, [5, 10])
    marker = json.loads((newer / saves.MARKER).read_text())
    marker["world_size"] = 1 << 20
    (newer / saves.MARKER).write_text(json.dumps(marker))
    named = []
    real = saves.rank_file

    def counting(rank: int) -> str:
        named.append(rank)
        return real(rank)

    monkeypatch.setattr(saves, "rank_file", counting)
    resumed, _ = _resume(tmp_path)
    assert resumed is not None
    assert resumed.path == older
    assert len(named) < 100  # not one name per claimed rank


@pytest.mark.parametrize("digits", ["٠٠٠٠٠٠٠٠٩", "０００００００１０", "00000001٠"])
def test_a_save_folder_named_with_other_scripts_digits_is_not_a_save(
    tmp_path: Path, digits: str
) -> None:
    older, newer = _save(tmp_path, [5, 10])
    token, count = newer.name.split("-")[2:]
    newer.rename(tmp_path / f"step-{digits}-{token}-{count}")
    resumed, _ = _resume(tmp_path)
    assert resumed is not None
    assert resumed.path == older


@pytest.mark.parametrize("step", [-1, 10**20, 1 << 63, 1.5, "7", True, None])
def test_a_step_that_no_resume_could_find_is_refused_when_set(tmp_path: Path, step: Any) -> None:
    with TrainingState(tmp_path, model=_model(), asynchronous=False) as state:
        with pytest.raises(InvalidArgumentError, match="is not a step"):
            state.step = step
        assert state.step == 0
        state.step = (1 << 63) - 1  # the largest is saved and found again
        state.save()
    with TrainingState(tmp_path, model=_model()) as state:
        resumed = state.resume()
    assert resumed is not None
    assert resumed.step == (1 << 63) - 1


# --- each part checked by structure before its loader ----------------------------------------


def _numpy_stream(**changes: Any) -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.RandomState(0).get_state()
    stream = {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    stream.update(changes)
    return stream


@pytest.mark.parametrize(
    "changes",
    [
        {"pos": 625},
        {"pos": 700},
        {"pos": 65536},
        {"keys": torch.zeros(10, dtype=torch.int64)},
        {"keys": torch.zeros(700, dtype=torch.int64)},
        {"keys": torch.full((624,), 1 << 40, dtype=torch.int64)},
        {"kind": "PCG64"},
    ],
    ids=["pos625", "pos700", "pos65536", "keys10", "keys700", "keys-wide", "kind"],
)
def test_a_numpy_stream_outside_mt19937_is_refused_and_nothing_is_restored(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    (save,) = _save(tmp_path, [5])
    own = _load(save, saves.rank_file(0))
    own["rng"]["numpy"] = _numpy_stream(**changes)
    _rewrite(save, saves.rank_file(0), own)
    np.random.seed(123)
    before = np.random.get_state()
    with pytest.raises(CheckpointError, match="NumPy") as refused:
        _resume(tmp_path)
    assert "resume from another save" in (refused.value.hint or "")
    after = np.random.get_state()
    assert after[2] == before[2]
    assert np.array_equal(after[1], before[1])


def test_numpy_streams_at_every_legal_position_are_restored(tmp_path: Path) -> None:
    (save,) = _save(tmp_path, [5])
    for pos in (0, 623, 624):
        own = _load(save, saves.rank_file(0))
        own["rng"]["numpy"] = _numpy_stream(pos=pos)
        _rewrite(save, saves.rank_file(0), own)
        _resume(tmp_path)
        assert np.random.get_state()[2] == pos


@pytest.mark.parametrize(
    "optimizer",
    [
        {"state": [], "param_groups": []},
        {"state": None, "param_groups": []},
        {"state": 7, "param_groups": []},
        7,
        [],
        {"state": {}, "param_groups": "x"},
        {"state": {}, "param_groups": [{"params": [0, 1, 2, 3]}]},
        {"state": {}, "param_groups": [{"params": [0, 0, 1, 2]}]},
        {"state": {}, "param_groups": [7]},
        {"state": {99: {}}, "param_groups": [{"params": [0, 1, 2, 3], "lr": 0.1}]},
        {"state": {0: 5}, "param_groups": [{"params": [0, 1, 2, 3], "lr": 0.1}]},
        {"state": {}, "param_groups": [{"params": [0, 1, 2, 3], "lr": "fast"}]},
    ],
)
def test_an_optimizer_state_unlike_the_live_optimizer_is_refused_typed(
    tmp_path: Path, optimizer: Any
) -> None:
    (save,) = _save(tmp_path, [5])
    shared = _load(save, saves.SHARED)
    live = shared["optimizer"]["param_groups"][0]
    if isinstance(optimizer, dict) and type(optimizer.get("param_groups")) is list:
        for group in optimizer["param_groups"]:
            if isinstance(group, dict) and "lr" in group:
                group.update({k: v for k, v in live.items() if k not in group})
    shared["optimizer"] = optimizer
    _rewrite(save, saves.SHARED, shared)
    model, opt, sched = _trained(7)
    before = opt.state_dict()
    with (
        TrainingState(tmp_path, model=model, optimizer=opt, scheduler=sched) as state,
        pytest.raises(CheckpointError, match="optimizer state that this optimizer"),
    ):
        state.resume()
    assert opt.state_dict()["param_groups"] == before["param_groups"]


def test_the_optimizer_check_takes_every_state_torch_writes(tmp_path: Path) -> None:
    for make in (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=0.01),
        lambda p: torch.optim.Adagrad(p),
        lambda p: torch.optim.RMSprop(p, momentum=0.5),
    ):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        model = _model()
        opt = make(model.parameters())
        model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()  # type: ignore[no-untyped-call]
        opt.step()
        with TrainingState(folder, model=model, optimizer=opt, asynchronous=False) as state:
            state.save()
        fresh = _model(1)
        again = make(fresh.parameters())
        with TrainingState(folder, model=fresh, optimizer=again) as state:
            assert state.resume() is not None
        assert again.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


@pytest.mark.parametrize(
    "extra", [{"state_dict": 5}, {"optimizer": 5}, {"step": "x"}, {"base_lrs": [1.0, 2.0]}]
)
def test_a_scheduler_state_with_keys_the_scheduler_lacks_is_refused(
    tmp_path: Path, extra: dict[str, Any]
) -> None:
    (save,) = _save(tmp_path, [5])
    shared = _load(save, saves.SHARED)
    shared["scheduler"].update(extra)
    _rewrite(save, saves.SHARED, shared)
    model, opt, sched = _trained(7)
    with (
        TrainingState(tmp_path, model=model, optimizer=opt, scheduler=sched) as state,
        pytest.raises(CheckpointError, match="scheduler state that this scheduler"),
    ):
        state.resume()
    assert sched.optimizer is opt
    assert callable(sched.state_dict)
    sched.step()  # still works


def _deflated(data: bytes) -> bytes:
    """The same zip archive with every record compressed (as `zip -r` would rewrite it)."""
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(data)) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst,
    ):
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    return out.getvalue()


def test_a_file_with_compressed_records_is_refused_before_torch_inflates_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    older, save = _save(tmp_path, [4, 5])
    shared = _load(save, saves.SHARED)
    shared["padding"] = torch.zeros(1 << 16)  # compresses a thousandfold
    _rewrite(save, saves.SHARED, _deflated(_torch_bytes(shared)))
    loads: list[object] = []
    real = torch.load

    def counting(*args: Any, **kwargs: Any) -> Any:
        source = args[0]
        if hasattr(source, "fileno"):  # the file the handle reads
            source = Path(os.readlink(f"/proc/self/fd/{source.fileno()}"))
        loads.append(source)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    resumed, _ = _resume(tmp_path)
    assert resumed is not None
    assert resumed.path == older  # passed over, as a damaged save is
    assert "holds a compressed record" in resumed.passed_over[0]
    assert older / saves.SHARED in loads  # what was read is seen here
    assert save / saves.SHARED not in loads
    with pytest.raises(CheckpointError, match="compressed record"):
        saves.load_part(save, saves.SHARED)
    assert save / saves.SHARED not in loads


def test_a_record_claiming_more_bytes_than_the_file_holds_is_refused(tmp_path: Path) -> None:
    older, save = _save(tmp_path, [4, 5])
    data = bytearray((save / saves.SHARED).read_bytes())
    # The central directory's first entry: its uncompressed size (offset 24 of the entry).
    entry = data.find(b"PK\x01\x02")
    data[entry + 24 : entry + 28] = (0x7FFFFFFF).to_bytes(4, "little")
    _rewrite(save, saves.SHARED, bytes(data))
    resumed, _ = _resume(tmp_path)
    assert resumed is not None
    assert resumed.path == older
    assert "claims more bytes" in resumed.passed_over[0]


# --- a full disk -----------------------------------------------------------------------------


@contextlib.contextmanager
def _small_disk(tmp_path: Path, size: str) -> Iterator[Path]:
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _save_and_wait(state: TrainingState) -> None:
    state.save()
    state.wait()


@needs_root
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_is_a_checkpoint_error_that_says_so_and_loses_nothing(
    tmp_path: Path, asynchronous: bool
) -> None:
    with _small_disk(tmp_path, "96k") as disk:
        model = nn.Linear(8, 8).double()
        with TrainingState(disk, model=model, asynchronous=asynchronous, keep=1) as state:
            state.step = 1
            state.save()
            state.wait()
            big = nn.Linear(128, 128).double()  # 130 KiB of weights: more than the disk
            state.model = big
            state.step = 2
            with pytest.raises(CheckpointError, match="no space left on the device") as full:
                _save_and_wait(state)
            assert "Free some space" in (full.value.hint or "")
            state.model = model
        names = [p.name for p in disk.iterdir()]
        assert len(names) == 1
        assert saves.check(disk / names[0]).step == 1


def test_a_marker_that_cannot_be_written_is_a_checkpoint_error_and_the_save_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (older,) = _save(tmp_path, [5])
    import gpukit.train.saves as saves_module

    def full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saves_module, "atomic_write", full)
    with TrainingState(tmp_path, model=_model(), asynchronous=False) as state:
        state.step = 6
        with pytest.raises(CheckpointError, match="no space left on the device"):
            state.save()
    assert [p.name for p in tmp_path.iterdir()] == [older.name]


# --- gk.load of a save's folder --------------------------------------------------------------


def test_gk_load_of_a_save_folder_loads_its_weights_once_its_digests_match(
    tmp_path: Path,
) -> None:
    import gpukit as gk

    (save,) = _save(tmp_path, [5])
    model = _model(9)
    gk.load(model, save)
    assert torch.equal(model[0].bias, torch.full((4,), 5.0, dtype=torch.float64))
    data = bytearray((save / saves.SHARED).read_bytes())
    data[len(data) // 2] ^= 0x10
    (save / saves.SHARED).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"shared\.pt is not what was saved") as refused:
        gk.load(_model(9), save)
    assert "load another save" in (refused.value.hint or "")


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "shared.pt/.."])
def test_gk_load_of_a_save_folder_refuses_a_marker_naming_files_outside_it(
    tmp_path: Path, name: str
) -> None:
    import gpukit as gk

    (save,) = _save(tmp_path, [5])
    marker = json.loads((save / saves.MARKER).read_text())
    marker["digests"][name] = "0" * 32
    (save / saves.MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="names a file or digest not of a save"):
        gk.load(_model(9), save)


# --- hostile parts, generated ----------------------------------------------------------------

_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.builds(
        lambda n, dtype: torch.zeros(n, dtype=dtype),
        st.integers(0, 700),
        st.sampled_from([torch.uint8, torch.int64, torch.float32, torch.float64]),
    ),
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-2, 5)), inner, max_size=5),
    ),
    max_leaves=12,
)
# Where a hostile value goes: a file of the save, then the path of keys inside its content.
_PLACES = [
    (saves.SHARED, ("step",)),
    (saves.SHARED, ("sharded",)),
    (saves.SHARED, ("model",)),
    (saves.SHARED, ("optimizer",)),
    (saves.SHARED, ("optimizer", "state")),
    (saves.SHARED, ("optimizer", "param_groups")),
    (saves.SHARED, ("scheduler",)),
    (saves.SHARED, ("scheduler", "last_epoch")),
    (saves.SHARED, ("loader",)),
    (saves.SHARED, ("extras",)),
    (saves.SHARED, ("extras", "best")),
    (saves.rank_file(0), ("rng",)),
    (saves.rank_file(0), ("rng", "python")),
    (saves.rank_file(0), ("rng", "python", "internal")),
    (saves.rank_file(0), ("rng", "numpy")),
    (saves.rank_file(0), ("rng", "numpy", "pos")),
    (saves.rank_file(0), ("rng", "numpy", "keys")),
    (saves.rank_file(0), ("rng", "torch")),
    (saves.rank_file(0), ("extras",)),
]


def _loader() -> Any:
    from torch.utils.data import DataLoader

    from gpukit.distributed.data import DistributedLoader

    inner = DataLoader(list(range(20)), batch_size=4, shuffle=True)
    return DistributedLoader(
        inner, batch_size=4, rank=0, world_size=1, device=torch.device("cpu"), seed=0
    )


@pytest.fixture(scope="module")
def complete_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hostile")
    model, opt, sched = _trained()
    with TrainingState(
        folder,
        model=model,
        optimizer=opt,
        scheduler=sched,
        loader=_loader(),
        extras={"best": [1.5]},
        asynchronous=False,
    ) as state:
        state.step = 3
        return state.save()


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(place=st.sampled_from(_PLACES), value=_VALUES)
def test_any_hostile_part_with_a_matching_digest_is_loaded_or_refused_typed(
    complete_save: Path, tmp_path_factory: pytest.TempPathFactory, place: Any, value: Any
) -> None:
    folder = tmp_path_factory.mktemp("resume")
    save = folder / complete_save.name
    shutil.copytree(complete_save, save)
    name, keys = place
    content = _load(save, name)
    inner = content
    for key in keys[:-1]:
        inner = inner[key]
    inner[keys[-1]] = value
    _rewrite(save, name, content)
    model, opt, sched = _trained(7)
    state = TrainingState(
        folder,
        model=model,
        optimizer=opt,
        scheduler=sched,
        loader=_loader(),
        extras={"best": [0.0]},
    )
    with state:
        try:
            state.resume()
        except GpukitError:
            return  # refused, typed, saying what is wrong
    # Taken: then what was taken works. A step and a save later, nothing raises.
    opt.zero_grad()
    model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()  # type: ignore[no-untyped-call]
    opt.step()
    sched.step()
    assert 0 <= state.step < 1 << 63
    np.random.random(2000)
    torch.rand(3)


def test_a_marker_whose_step_disagrees_with_its_folder_name_is_passed_over(
    tmp_path: Path,
) -> None:
    older, newer = _save(tmp_path, [1, 2])
    marker = json.loads((older / saves.MARKER).read_text())
    marker["step"] = 7  # one changed digit would make the older save the newest for good
    (older / saves.MARKER).write_text(json.dumps(marker))
    resumed, _ = _resume(tmp_path)
    assert resumed is not None
    assert resumed.path == newer
    assert any("its marker says step 7, its name step 1" in line for line in resumed.passed_over)
