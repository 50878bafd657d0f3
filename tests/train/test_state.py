"""gk.TrainingState in one process: what a save holds, which save resume takes, what it refuses."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.checkpoint.digests import digest
from gpukit.errors import CheckpointError, InvalidArgumentError
from gpukit.train import TrainingState, saves
from tests.helpers.two_processes import OtherRank, two_processes


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(5, 3, dtype=torch.float64)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def _state(folder: Path, model: nn.Module, **options: Any) -> TrainingState:
    return TrainingState(folder, model=model, **options)


def _saved_at(folder: Path, steps: list[int], keep: int = 10) -> nn.Module:
    model = _model()
    with _state(folder, model, keep=keep) as state:
        for step in steps:
            state.step = step
            with torch.no_grad():
                model[0].weight.fill_(step)
            state.save()
    return model


def test_resume_in_a_folder_without_saves_returns_none_and_changes_nothing(
    tmp_path: Path,
) -> None:
    model = _model()
    before = [p.clone() for p in model.parameters()]
    with _state(tmp_path / "none", model) as state:
        assert state.resume() is None
        assert state.step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_resume_gives_back_every_part_and_this_processes_random_streams(
    tmp_path: Path,
) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    counter = Counter()
    with _state(
        tmp_path, model, optimizer=opt, scheduler=sched, extras={"c": counter, "best": [1.5]}
    ) as state:
        _train(model, opt, 3)
        sched.step()
        counter.count = 7
        assert state.step == 3  # the optimizer's three steps, counted
        state.save()
    streams = torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)]

    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    fresh = _model(seed=1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2, gamma=0.5)
    fresh_counter = Counter()
    with _state(
        tmp_path,
        fresh,
        optimizer=fresh_opt,
        scheduler=fresh_sched,
        extras={"c": fresh_counter, "best": None},
    ) as state:
        resumed = state.resume()
        assert resumed is not None
        assert (resumed.step, state.step, resumed.world_size) == (3, 3, 1)
        assert state.extras["best"] == [1.5]
    assert torch.equal(torch.rand(3), streams[0])
    assert np.array_equal(np.random.rand(3), streams[1])
    assert [random.random() for _ in range(3)] == streams[2]
    assert fresh_counter.count == 7
    assert fresh_sched.state_dict() == sched.state_dict()
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )


def test_resume_continues_the_optimizer_exactly(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with _state(tmp_path, model, optimizer=opt) as state:
        _train(model, opt, 3)
        state.save()
    torch.manual_seed(11)
    _train(model, opt, 2)
    fresh = _model(seed=1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    with _state(tmp_path, fresh, optimizer=fresh_opt) as state:
        state.resume()
    torch.manual_seed(11)
    _train(fresh, fresh_opt, 2)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )


def test_resume_takes_the_newest_complete_save_and_says_which_newer_one_it_passed_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saved_at(tmp_path, [5, 10])
    newest = max(tmp_path.iterdir(), key=lambda p: p.name)
    (newest / saves.MARKER).unlink()  # as a kill before the marker leaves it
    model = _model()
    with caplog.at_level(logging.INFO, logger="gpukit.train"), _state(tmp_path, model) as state:
        resumed = state.resume()
    assert resumed is not None
    assert resumed.step == 5
    assert float(model[0].weight[0, 0].detach()) == 5.0
    assert any(newest.name in line and "incomplete" in line for line in resumed.passed_over)
    assert str(resumed.path) in caplog.text


def test_a_save_with_a_file_cut_short_is_passed_over_for_the_one_before(tmp_path: Path) -> None:
    _saved_at(tmp_path, [5, 10])
    newest = max(tmp_path.iterdir(), key=lambda p: p.name)
    shared = newest / saves.SHARED
    shared.write_bytes(shared.read_bytes()[:100])
    with _state(tmp_path, _model()) as state:
        resumed = state.resume()
    assert resumed is not None
    assert resumed.step == 5
    assert "bytes, the marker says" in resumed.passed_over[0]


def test_a_file_of_a_save_replaced_by_a_link_is_not_followed(tmp_path: Path) -> None:
    _saved_at(tmp_path, [5])
    only = next(tmp_path.iterdir())
    secret = tmp_path.parent / "secret.pt"
    torch.save({"step": 1}, secret)
    (only / saves.SHARED).unlink()
    (only / saves.SHARED).symlink_to(secret)
    with _state(tmp_path, _model()) as state:
        assert state.resume() is None


@pytest.mark.parametrize(
    "marker",
    [
        b"not json",
        b'{"format": 1, "step": 1e400, "world_size": 1, "files": {}, "time_ns": 0}',
        b'{"format": 1, "step": 3, "world_size": 99999999999, "files": {}, "time_ns": 0}',
        b'{"format": 1, "step": 3, "world_size": 1, "files": {"../x": 1}, "time_ns": 0}',
        b"[" * 100_000,
    ],
)
def test_a_hostile_marker_makes_the_save_passed_over_not_a_crash(
    tmp_path: Path, marker: bytes
) -> None:
    _saved_at(tmp_path, [5, 10])
    newest = max(tmp_path.iterdir(), key=lambda p: p.name)
    (newest / saves.MARKER).write_bytes(marker)
    with _state(tmp_path, _model()) as state:
        resumed = state.resume()
    assert resumed is not None
    assert resumed.step == 5


@pytest.mark.parametrize(
    "names",
    [
        ["sharded/.metadata", "sharded/../shared.pt"],  # out of the sharded part
        ["sharded/.metadata", "sharded/__1_0.distcp"],  # a rank beyond the one that saved
        ["sharded/__0_0.distcp"],  # shards without DCP's metadata
        ["sharded/.metadata", "sharded/x/.metadata"],  # not a file of DCP's
    ],
)
def test_a_marker_naming_other_files_as_the_sharded_part_makes_the_save_passed_over(
    tmp_path: Path, names: list[str]
) -> None:
    _saved_at(tmp_path, [5, 10])
    newest = max(tmp_path.iterdir(), key=lambda p: p.name)
    marker = json.loads((newest / saves.MARKER).read_text())
    (newest / "sharded" / "x").mkdir(parents=True)
    for name in names:
        (newest / name).write_bytes(b"")
        marker["files"][name] = 0
        marker["digests"][name] = "0" * 32
    (newest / saves.MARKER).write_text(json.dumps(marker))
    with _state(tmp_path, _model()) as state:
        resumed = state.resume()
    assert resumed is not None
    assert resumed.step == 5
    assert "its marker names other files" in resumed.passed_over[0]


def test_a_sharded_part_replaced_by_a_link_to_a_folder_is_not_followed(tmp_path: Path) -> None:
    _saved_at(tmp_path, [5])
    only = next(tmp_path.iterdir())
    elsewhere = tmp_path.parent / "elsewhere"
    elsewhere.mkdir()
    marker = json.loads((only / saves.MARKER).read_text())
    for name in (".metadata", "__0_0.distcp"):  # the whole sharded part of one rank
        (elsewhere / name).write_bytes(b"")
        marker["files"][f"sharded/{name}"] = 0
        marker["digests"][f"sharded/{name}"] = "0" * 32
    (only / "sharded").symlink_to(elsewhere)
    (only / saves.MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="sharded is not a folder"):
        saves.check(only)


def test_keep_n_leaves_the_n_newest_complete_saves(tmp_path: Path) -> None:
    _saved_at(tmp_path, [1, 2, 3, 4], keep=2)
    steps = sorted(saves.check(p).step for p in tmp_path.iterdir())
    assert steps == [3, 4]


def test_an_asynchronous_save_holds_the_weights_of_the_moment_it_was_called(
    tmp_path: Path,
) -> None:
    model = _model()
    with _state(tmp_path, model) as state:
        state.save()
        with torch.no_grad():  # the loop goes on at once, while the save is written
            for p in model.parameters():
                p.add_(1.0)
    original = _model()
    fresh = _model(seed=3)
    with _state(tmp_path, fresh) as state:
        state.resume()
    assert all(
        torch.equal(a, b) for a, b in zip(original.parameters(), fresh.parameters(), strict=True)
    )


def test_a_save_that_fails_raises_and_leaves_the_previous_complete_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved_at(tmp_path, [5])
    model = _model()

    def full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    with _state(tmp_path, model) as state:
        state.step = 10
        monkeypatch.setattr(torch, "save", full)
        state.save()
        with pytest.raises(CheckpointError, match="no space left on the device"):
            state.wait()
        monkeypatch.undo()
        assert [saves.check(p).step for p in tmp_path.iterdir()] == [5]  # nothing half-written
        assert state.resume() is not None
        assert state.step == 5


def test_a_save_from_a_wrapped_model_resumes_into_the_bare_model(tmp_path: Path) -> None:
    model = _model()
    with _state(tmp_path, nn.DataParallel(model)) as state:
        state.save()
    fresh = _model(seed=4)
    with _state(tmp_path, fresh) as state:
        state.resume()
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_resuming_another_models_save_is_refused_naming_the_mismatch(tmp_path: Path) -> None:
    _saved_at(tmp_path, [5])
    with (
        _state(tmp_path, nn.Linear(2, 2)) as state,
        pytest.raises(CheckpointError, match="another model"),
    ):
        state.resume()


def test_a_run_with_an_optimizer_refuses_a_save_without_one(tmp_path: Path) -> None:
    _saved_at(tmp_path, [5])
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        _state(tmp_path, model, optimizer=opt) as state,
        pytest.raises(CheckpointError, match="no optimizer"),
    ):
        state.resume()


def test_random_streams_changed_in_a_save_are_refused(tmp_path: Path) -> None:
    _saved_at(tmp_path, [5])
    only = next(tmp_path.iterdir())
    own = only / saves.rank_file(0)
    torch.save({"rng": {"python": "x"}, "extras": {}}, own)
    size = own.stat().st_size
    found = json.loads((only / saves.MARKER).read_text())
    found["files"][saves.rank_file(0)] = size
    found["digests"][saves.rank_file(0)] = digest(own)
    (only / saves.MARKER).write_text(json.dumps(found))
    with _state(tmp_path, _model()) as state, pytest.raises(CheckpointError, match="random"):
        state.resume()


@pytest.mark.parametrize(
    "extras",
    [{"f": lambda: 1}, {"s": {1, 2}}, {"d": {1: "key not a str"}}],
)
def test_extras_a_save_could_not_read_back_as_data_are_refused_at_once(
    tmp_path: Path, extras: dict[str, Any]
) -> None:
    with pytest.raises(InvalidArgumentError, match="extras"):
        TrainingState(tmp_path, model=_model(), extras=extras)


def test_a_part_without_state_dict_is_refused_naming_the_slot(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="scheduler"):
        TrainingState(tmp_path, model=_model(), scheduler=object())


@pytest.mark.parametrize("keep", [0, -1, True, 1.5])
def test_keep_must_be_a_positive_whole_number(tmp_path: Path, keep: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="keep"):
        TrainingState(tmp_path, model=_model(), keep=keep)


def test_the_training_state_is_a_top_level_name() -> None:
    assert gk.TrainingState is TrainingState


def test_consecutive_asynchronous_saves_each_hold_their_own_moment(tmp_path: Path) -> None:
    model = _model()
    with _state(tmp_path, model, keep=5) as state:
        for step in (1, 2, 3):
            with torch.no_grad():
                model[0].weight.fill_(step)
            state.step = step
            state.save()  # copies into the buffers of the save before, once that one is written
    for path in tmp_path.iterdir():
        info = saves.check(path)
        weight = saves.load_part(path, saves.SHARED)["model"]["0.weight"]
        assert torch.all(weight == info.step)


def test_an_optimizer_of_another_shape_is_refused_naming_the_part(tmp_path: Path) -> None:
    model = _model()
    with _state(tmp_path, model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as state:
        state.save()
    other = _model()
    opt = torch.optim.SGD([next(other.parameters())], lr=0.1)  # one group of one parameter
    with (
        _state(tmp_path, other, optimizer=opt) as state,
        pytest.raises(CheckpointError, match="optimizer state"),
    ):
        state.resume()


def test_a_gradient_scaler_and_a_training_step_state_come_back(tmp_path: Path) -> None:
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(1))  # the scale exists from the first use on
    scaler.update(new_scale=256.0)
    phase = Counter()  # a training step's stand-in: anything with state_dict/load_state_dict
    phase.count = 3
    with _state(tmp_path, model, scaler=scaler, train_step=phase) as state:
        state.save()
    fresh_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    fresh_phase = Counter()
    with _state(tmp_path, _model(), scaler=fresh_scaler, train_step=fresh_phase) as state:
        state.resume()
    assert fresh_scaler.get_scale() == 256.0
    assert fresh_phase.count == 3


def test_an_error_in_the_training_block_is_not_hidden_by_a_failing_last_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    def train_then_fail() -> None:
        with _state(tmp_path, _model()) as state:
            monkeypatch.setattr(torch, "save", full)
            state.save()
            raise KeyError("the loop's own")

    with pytest.raises(KeyError, match="the loop's own"):
        train_then_fail()


# -- the step counts the optimizer's steps --------------------------------------------------------


def test_the_step_counts_the_optimizers_steps_by_itself_in_a_plain_loop(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _state(tmp_path, model, optimizer=opt, asynchronous=False) as state:
        _train(model, opt, 3)
        assert state.step == 3
        saved = state.save()
    assert saved.name.startswith("step-000000003-")


def test_under_accumulation_the_step_counts_optimizer_steps_not_micro_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(20, 3, dtype=torch.float64))
    model, opt, loader = gk.distributed.prepare(
        model,
        opt,
        torch.utils.data.DataLoader(data, batch_size=4),
        global_batch_size=8,
        accumulate=2,
    )
    with _state(tmp_path, model, optimizer=opt, loader=loader) as state:
        answers = [gk.distributed.step(model(x).square().mean()) for (x,) in loader]
        # 20 samples: windows of 4 + 4, 4 + 4, then one micro-batch of 4: 5 calls, 3 steps.
        assert (len(answers), answers.count(True), state.step) == (5, 3, 3)


def test_an_fp16_step_the_scaler_skips_is_not_counted(tmp_path: Path) -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fp16_on_cpu = gk.train.Precision("fp16-mixed", "cpu", torch.float16)
    train_step = gk.train.TrainStep(model, opt, precision=fp16_on_cpu)
    with _state(tmp_path, model, optimizer=opt, train_step=train_step) as state:
        for value in (1.0, float("inf"), 1.0):
            train_step(model(torch.full((1, 3), value)).mean())
        assert (train_step.skipped_steps, state.step) == (1, 2)


def test_setting_the_step_by_hand_once_it_counts_is_refused_naming_the_line_to_remove(
    tmp_path: Path,
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _state(tmp_path, model, optimizer=opt) as state:
        _train(model, opt, 1)
        with pytest.raises(InvalidArgumentError, match="counts its optimizer's steps") as raised:
            state.step += 1
        assert "Remove `state.step += 1`" in (raised.value.hint or "")
        assert state.step == 1


def test_a_resumed_state_counts_on_from_the_saved_step(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _state(tmp_path, model, optimizer=opt) as state:
        _train(model, opt, 4)
        state.save()
    fresh = _model(seed=1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    with _state(tmp_path, fresh, optimizer=fresh_opt, asynchronous=False) as state:
        resumed = state.resume()
        assert resumed is not None
        assert (resumed.step, state.step) == (4, 4)
        _train(fresh, fresh_opt, 2)
        assert state.step == 6
        assert state.save().name.startswith("step-000000006-")


# -- one switch: asynchronous ---------------------------------------------------------------------


def test_a_save_asked_not_to_be_asynchronous_is_complete_when_it_returns(tmp_path: Path) -> None:
    model = _model()
    with _state(tmp_path, model) as state:  # asynchronous by default
        saved = state.save(asynchronous=False)
        assert (saved / saves.MARKER).is_file()
        assert state.wait() == saved  # nothing was left to wait for
        with pytest.raises(TypeError, match="blocking"):
            state.save(blocking=True)  # type: ignore[call-arg]


@pytest.mark.parametrize("value", ["no", 0, 1])
def test_an_asynchronous_switch_that_is_not_a_bool_is_refused(
    tmp_path: Path, value: object
) -> None:
    with pytest.raises(InvalidArgumentError, match="asynchronous="):
        TrainingState(tmp_path, model=_model(), asynchronous=value)  # type: ignore[arg-type]
    with (
        _state(tmp_path, _model()) as state,
        pytest.raises(InvalidArgumentError, match="asynchronous="),
    ):
        state.save(asynchronous=value)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


# -- the training step, by its name ---------------------------------------------------------------


def _fp16_step(model: nn.Module) -> gk.train.TrainStep:
    fp16_on_cpu = gk.train.Precision("fp16-mixed", "cpu", torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return gk.train.TrainStep(model, opt, precision=fp16_on_cpu, accumulate=2)


def test_the_training_step_is_saved_as_train_step_and_comes_back(tmp_path: Path) -> None:
    model = nn.Linear(3, 1)
    saved_step = _fp16_step(model)
    saved_step(model(torch.full((1, 3), float("inf"))).mean())
    saved_step(model(torch.full((1, 3), float("inf"))).mean())  # a skipped step
    with _state(tmp_path, model, train_step=saved_step, asynchronous=False) as state:
        path = state.save()
    assert "train_step" in torch.load(path / saves.SHARED, weights_only=True)
    fresh_step = _fp16_step(nn.Linear(3, 1))
    with _state(tmp_path, nn.Linear(3, 1), train_step=fresh_step) as state:
        state.resume()
    assert fresh_step.skipped_steps == 1
    assert fresh_step.state_dict() == saved_step.state_dict()


def test_a_save_holding_the_training_step_under_its_former_name_resumes(tmp_path: Path) -> None:
    model = nn.Linear(3, 1)
    saved_step = _fp16_step(model)
    for _ in range(2):
        saved_step(model(torch.full((1, 3), float("inf"))).mean())
    with _state(tmp_path, model, train_step=saved_step, asynchronous=False) as state:
        path = state.save()
    shared = torch.load(path / saves.SHARED, weights_only=True)
    shared["accumulation"] = shared.pop("train_step")  # as saves made before the rename
    torch.save(shared, path / saves.SHARED)
    marker = json.loads((path / saves.MARKER).read_text())
    marker["files"][saves.SHARED] = (path / saves.SHARED).stat().st_size
    marker["digests"][saves.SHARED] = digest(path / saves.SHARED)
    (path / saves.MARKER).write_text(json.dumps(marker))
    fresh_step = _fp16_step(nn.Linear(3, 1))
    with _state(tmp_path, nn.Linear(3, 1), train_step=fresh_step) as state:
        assert state.resume() is not None
    assert fresh_step.skipped_steps == 1


# -- extras are rank 0's: a warning when they differ ----------------------------------------------


def save_with_extras(rank: int, folder: str, extras: dict[str, Any]) -> str:
    """Save a state with ``extras`` from ``rank`` of a group of two; the save's name."""
    del rank  # the group knows it
    with TrainingState(folder, model=_model(), extras=extras, asynchronous=False) as state:
        return state.save().name


@pytest.fixture(scope="class")
def other_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as other:
        yield other


class TestInAGroupOfTwoProcesses:
    """Rank 0 is this process; the group lives only while these tests run."""

    def test_extras_that_differ_between_ranks_are_named_in_a_warning_pointing_to_rank_extras(
        self, other_rank: OtherRank, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        alike = {"lr": 0.1, "table": torch.arange(3.0)}  # the same on both ranks: not named
        other_rank.run(save_with_extras, str(tmp_path), {"best": [2.0], "seen": 5, **alike})
        with caplog.at_level(logging.WARNING, logger="gpukit.train"):
            here = save_with_extras(0, str(tmp_path), {"best": [1.0], "seen": 4, **alike})
        assert other_rank.result() == here
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1
        assert "'best', 'seen' differ between the ranks" in warned[0]
        assert "'lr'" not in warned[0]
        assert "'table'" not in warned[0]
        assert "rank_extras" in warned[0]
