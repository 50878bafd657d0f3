"""What gk.TrainingState says and leaves behind, word for word, in one process.

Each refusal is checked whole (its message and its hint): what a user reads is what tells them
what to change. Besides the refusals: what a save is named, what it asks of each part, what a
resume logs and reads, which parts come back (the loader's training step, each rank's extras),
and a model sharded with FSDP2 in a group of this process alone.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpukit.errors import CheckpointError, InvalidArgumentError
from gpukit.train import TrainingState, saves
from gpukit.train._writing import SaveJob
from gpukit.train.shard import shard

MAX_STEP = (1 << 63) - 1
MALFORMED_HINT = "The save was changed after it was written; resume from another save."
STEP_HINT = (
    "Leave state.step to the state: it counts each optimizer.step() itself. Set it by hand only "
    "where no optimizer is given, to an int (state.step += 1)."
)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 3, dtype=torch.float64)).square().mean().backward()  # type: ignore[no-untyped-call]
        opt.step()


class Counter:
    """A stateful part: its count is its state; it counts the times it was asked for it."""

    def __init__(self, count: int = 0) -> None:
        self.count = count
        self.asked = 0

    def state_dict(self) -> dict[str, int]:
        self.asked += 1
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


class Refusing(Counter):
    """A stateful part whose loader refuses any state with ``error``."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise self.error


class LoaderWithStep(Counter):
    """A prepared loader carries the training step."""

    def __init__(self, count: int = 0, step_count: int = 0) -> None:
        super().__init__(count)
        self.train_step = Counter(step_count)


class MidStep(Counter):
    """A training step between the micro-batches of an optimizer step."""

    mid_step = True

    def state_dict(self) -> dict[str, int]:
        raise InvalidArgumentError("between micro-batches", hint="Save after the step.")


def _saved(folder: Path, **options: Any) -> Path:
    """One complete save at step 3 of :func:`_model` with ``options``; its folder."""
    with TrainingState(folder, model=_model(), asynchronous=False, **options) as state:
        state.step = 3
        return state.save()


def _rewrite(save: Path, name: str, content: object) -> None:
    """Replace one file of a save with ``content`` and mark the save again, digests agreeing:
    a save another version of the script, or someone with write access, could have written."""
    torch.save(content, save / name)
    (save / saves.MARKER).unlink()
    saves.finish(save, step=3, world_size=1)


def _changed_shared(save: Path, **changes: Any) -> None:
    shared = torch.load(save / saves.SHARED, weights_only=True)
    shared.update(changes)
    _rewrite(save, saves.SHARED, shared)


def _resume_error(folder: Path, **options: Any) -> CheckpointError:
    with (
        TrainingState(folder, model=_model(1), **options) as state,
        pytest.raises(CheckpointError) as caught,
    ):
        state.resume()
    return caught.value


def _said(error: Exception, message: str, hint: str) -> None:
    assert isinstance(error, (CheckpointError, InvalidArgumentError))
    assert (error.message, error.hint) == (message, hint)
    assert str(error) == f"{message} {hint}"


# --- refusals at construction ------------------------------------------------------------


def test_a_model_that_is_not_a_module_is_refused_naming_its_type(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        TrainingState(tmp_path, model=[1, 2])  # type: ignore[arg-type]
    _said(
        caught.value,
        "TrainingState got model=list, not a torch.nn.Module.",
        "Pass the model being trained (wrapped in DDP or not).",
    )


@pytest.mark.parametrize("keep", [0, -1, 2.0, True])
def test_a_keep_that_is_no_number_of_saves_is_refused_saying_what_to_pass(
    tmp_path: Path, keep: Any
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        TrainingState(tmp_path, model=_model(), keep=keep)
    _said(
        caught.value,
        f"keep={keep!r} is not a number of saves to keep.",
        "Pass a whole number >= 1 (2 keeps one save to fall back on).",
    )


@pytest.mark.parametrize("slot", ["optimizer", "scheduler", "scaler", "loader", "train_step"])
def test_a_part_without_state_dict_is_refused_naming_its_slot_and_type(
    tmp_path: Path, slot: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        TrainingState(tmp_path, model=_model(), **{slot: 7})
    _said(
        caught.value,
        f"TrainingState got {slot}=int, which has no state_dict()/load_state_dict().",
        f"Pass a {slot} that has both, or pass it in extras as plain data.",
    )


@pytest.mark.parametrize("label", ["extras", "rank_extras"])
def test_an_extra_named_by_no_string_is_refused_naming_the_argument(
    tmp_path: Path, label: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        TrainingState(tmp_path, model=_model(), **{label: {"fine": 1, 3: 2}})
    _said(caught.value, f"{label} has the key 3, not a string.", "Name each extra by a str.")


# --- the step ----------------------------------------------------------------------------


@pytest.mark.parametrize("step", [-1, MAX_STEP + 1, "3", 2.0, None])
def test_a_step_no_resume_could_find_is_refused_saying_which_steps_are(
    tmp_path: Path, step: Any
) -> None:
    with TrainingState(tmp_path, model=_model()) as state:
        with pytest.raises(InvalidArgumentError) as caught:
            state.step = step
        assert state.step == 0
    _said(
        caught.value,
        f"TrainingState.step = {step!r} is not a step: a whole number from 0 to {MAX_STEP} (a "
        "save at any other step could not be resumed).",
        STEP_HINT,
    )


def test_the_last_step_there_is_can_be_set_saved_and_resumed(tmp_path: Path) -> None:
    with TrainingState(tmp_path, model=_model(), asynchronous=False) as state:
        state.step = MAX_STEP
        saved = state.save()
    with TrainingState(tmp_path, model=_model(1)) as state:
        resumed = state.resume()
        assert resumed is not None
        assert (resumed.path, resumed.step, state.step) == (saved, MAX_STEP, MAX_STEP)


def test_the_optimizers_steps_are_still_counted_after_a_save(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with TrainingState(tmp_path, model=model, optimizer=opt) as state:
        _train(model, opt, 2)
        state.save()
        _train(model, opt, 3)
        assert state.step == 5
        assert state.save().name.startswith("step-000000005-")


# --- saves: names, parts asked once, the writer --------------------------------------------


def test_a_runs_saves_are_numbered_from_0_in_order_under_one_12_digit_token(
    tmp_path: Path,
) -> None:
    with TrainingState(tmp_path, model=_model(), keep=10) as state:
        made = [state.save().name for _ in range(3)]
        state.wait()
    token = made[0].split("-")[2]
    assert re.fullmatch("[0-9a-f]{12}", token), made
    assert made == [f"step-000000000-{token}-{count}" for count in range(3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == made


def test_two_saves_are_kept_by_default(tmp_path: Path) -> None:
    with TrainingState(tmp_path, model=_model(), asynchronous=False) as state:
        made = []
        for step in (1, 2, 3):
            state.step = step
            made.append(state.save())
    assert sorted(tmp_path.iterdir()) == made[1:]


def test_a_save_asks_each_part_and_each_extra_for_its_state_once(tmp_path: Path) -> None:
    parts = {name: Counter() for name in ("scheduler", "scaler", "loader", "train_step")}
    extra, own = Counter(), Counter()
    with TrainingState(
        tmp_path, model=_model(), extras={"extra": extra}, rank_extras={"own": own}, **parts
    ) as state:
        state.save()
        state.save(asynchronous=False)
    assert {name: part.asked for name, part in parts.items()} == dict.fromkeys(parts, 2)
    assert (extra.asked, own.asked) == (2, 2)


def test_a_save_refused_between_micro_batches_leaves_nothing_and_takes_no_number(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "run"
    step = MidStep()
    with TrainingState(folder, model=_model(), train_step=step, asynchronous=False) as state:
        with pytest.raises(InvalidArgumentError, match=r"^between micro-batches"):
            state.save()
        assert not folder.exists()
        step.mid_step = False  # type: ignore[misc]
        step.state_dict = lambda: {"count": 0}  # type: ignore[method-assign]
        assert state.save().name.endswith("-0")


def test_the_save_is_written_by_a_thread_named_gpukit_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names: list[str] = []
    run = SaveJob.run

    def noted(job: SaveJob) -> Path:
        names.append(threading.current_thread().name)
        return run(job)

    monkeypatch.setattr(SaveJob, "run", noted)
    with TrainingState(tmp_path, model=_model()) as state:
        assert state.wait() is None  # nothing saved yet
        saved = state.save()
        assert state.wait() == saved
    assert len(names) == 1
    assert re.fullmatch(r"gpukit-save_\d+", names[0]), names


def test_a_save_folder_that_cannot_be_made_is_a_checkpoint_error_saying_why(
    tmp_path: Path,
) -> None:
    with TrainingState(tmp_path, model=_model(), asynchronous=False) as state:
        first = state.save()
        token = first.name.split("-")[2]
        blocked = tmp_path / f"step-000000000-{token}-1"
        blocked.write_text("a file where the next save's folder goes")
        with pytest.raises(CheckpointError) as caught:
            state.save()
    _said(
        caught.value,
        f"Cannot save the training state into {blocked}: File exists.",
        "Pass a folder this process can create and write (on a shared file system when the "
        "ranks run on several machines).",
    )
    assert blocked.is_file()


def test_an_extra_changed_into_something_that_is_not_data_is_refused_at_the_save(
    tmp_path: Path,
) -> None:
    with TrainingState(tmp_path, model=_model(), extras={"best": 1.0}) as state:
        state.extras["best"] = object()
        with pytest.raises(InvalidArgumentError, match=r"^extras\['best'\] is "):
            state.save()
    assert list(tmp_path.iterdir()) == []


def test_extras_and_rank_extras_of_one_name_and_shape_are_each_saved_as_they_were(
    tmp_path: Path,
) -> None:
    # Staged to host memory for the writer, each by its own stager: the one copy must not
    # take the other's buffer.
    with TrainingState(
        tmp_path,
        model=_model(),
        extras={"x": torch.zeros(4)},
        rank_extras={"x": torch.ones(4)},
    ) as state:
        state.save()
        state.save()
    with TrainingState(
        tmp_path, model=_model(), extras={"x": None}, rank_extras={"x": None}
    ) as state:
        assert state.resume() is not None
        assert torch.equal(state.extras["x"], torch.zeros(4))
        assert torch.equal(state.rank_extras["x"], torch.ones(4))


def test_closing_twice_is_harmless(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with TrainingState(tmp_path, model=model, optimizer=opt) as state:
        state.save()
    state.close()
    _train(model, opt, 1)
    assert state.step == 0  # closed: the optimizer no longer counts into it


def test_a_last_save_that_fails_after_an_error_in_the_block_is_logged_naming_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    def train_then_fail() -> None:
        with TrainingState(tmp_path, model=_model()) as state:
            state.save()
            raise KeyError("the block's own")

    monkeypatch.setattr(torch, "save", full)
    with (
        caplog.at_level(logging.ERROR, logger="gpukit.train"),
        pytest.raises(KeyError, match="the block's own"),
    ):
        train_then_fail()
    logged = [r for r in caplog.records if r.name == "gpukit.train"]
    assert [r.getMessage() for r in logged] == [f"the last save of {tmp_path} failed too"]
    assert logged[0].exc_info is not None
    assert isinstance(logged[0].exc_info[1], CheckpointError)


# --- resuming: what comes back, what is logged, what is read --------------------------------


def test_a_resume_logs_where_it_starts_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="gpukit.train"):
        with TrainingState(tmp_path, model=_model()) as state:
            assert state.resume() is None
        saved = _saved(tmp_path)
        with TrainingState(tmp_path, model=_model()) as state:
            assert state.resume() is not None
    said = [r.getMessage() for r in caplog.records if r.name == "gpukit.train"]
    assert said == [
        f"no complete save in {tmp_path}: starting from step 0",
        f"resumed from {saved} (step 3, saved by 1 process)",
    ]


def test_a_resume_from_another_folder_takes_that_folders_save(tmp_path: Path) -> None:
    saved = _saved(tmp_path / "earlier")
    with TrainingState(tmp_path / "now", model=_model(1)) as state:
        resumed = state.resume(tmp_path / "earlier")
        assert resumed is not None
        assert (resumed.path, resumed.step, resumed.world_size) == (saved, 3, 1)
        assert state.step == 3
        assert state.resume(str(tmp_path / "now")) is None


def test_a_resume_reads_each_file_of_the_save_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(tmp_path)
    read: list[str] = []
    load = saves.load_part

    def noted(folder: Path, name: str) -> Any:
        read.append(name)
        return load(folder, name)

    monkeypatch.setattr(saves, "load_part", noted)
    with TrainingState(tmp_path, model=_model(1)) as state:
        assert state.resume() is not None
    assert sorted(read) == sorted([saves.SHARED, saves.rank_file(0)])


def test_the_training_step_of_a_prepared_loader_is_saved_and_comes_back(tmp_path: Path) -> None:
    _saved(tmp_path, loader=LoaderWithStep(count=4, step_count=9))
    loader = LoaderWithStep()
    with TrainingState(tmp_path, model=_model(1), loader=loader) as state:
        assert state.resume() is not None
    assert (loader.count, loader.train_step.count) == (4, 9)
    shared = torch.load(next(tmp_path.iterdir()) / saves.SHARED, weights_only=True)
    assert (shared["loader"], shared["train_step"]) == ({"count": 4}, {"count": 9})


def test_each_ranks_own_extras_come_back(tmp_path: Path) -> None:
    own = Counter(5)
    _saved(tmp_path, rank_extras={"seen": [1, 2], "own": own})
    fresh = Counter()
    with TrainingState(
        tmp_path, model=_model(1), rank_extras={"seen": None, "own": fresh}
    ) as state:
        assert state.resume() is not None
        assert state.rank_extras["seen"] == [1, 2]
    assert fresh.count == 5


def test_a_save_of_a_two_process_run_gives_one_process_rank_0s_streams(tmp_path: Path) -> None:
    torch.manual_seed(11)
    save = _saved(tmp_path)
    expected = torch.rand(3)
    own = torch.load(save / saves.rank_file(0), weights_only=False)
    torch.manual_seed(12)
    other = {**own, "rng": {**own["rng"], "torch": torch.get_rng_state()}}
    torch.save(other, save / saves.rank_file(1))
    (save / saves.MARKER).unlink()
    saves.finish(save, step=3, world_size=2)
    with TrainingState(tmp_path, model=_model(1)) as state:
        resumed = state.resume()
    assert resumed is not None
    assert resumed.world_size == 2
    assert torch.equal(torch.rand(3), expected)


def test_a_duck_typed_optimizer_and_scheduler_are_loaded_as_they_are(tmp_path: Path) -> None:
    _saved(tmp_path, optimizer=Counter(3), scheduler=Counter(4))
    optimizer, scheduler = Counter(), Counter()
    with TrainingState(
        tmp_path, model=_model(1), optimizer=optimizer, scheduler=scheduler
    ) as state:
        assert state.resume() is not None
    assert (optimizer.count, scheduler.count) == (3, 4)


# --- resuming: refusals, whole ---------------------------------------------------------------


def test_another_models_weights_are_refused_with_torchs_first_line(tmp_path: Path) -> None:
    save = _saved(tmp_path)
    with (
        TrainingState(tmp_path, model=nn.Sequential(nn.Linear(2, 2))) as state,
        pytest.raises(CheckpointError) as caught,
    ):
        state.resume()
    _said(
        caught.value,
        f"{save} holds another model's weights: Error(s) in loading state_dict for Sequential:",
        "Resume with the model the run saved, or start in another folder.",
    )


def test_a_part_the_save_lacks_is_refused_naming_it(tmp_path: Path) -> None:
    save = _saved(tmp_path)
    error = _resume_error(tmp_path, scheduler=Counter())
    _said(
        error,
        f"{save} holds no scheduler state, and this run has a scheduler.",
        "Resume without a scheduler, or from a save of a run that had one.",
    )


def test_an_optimizer_state_the_optimizer_cannot_take_is_refused_saying_why(
    tmp_path: Path,
) -> None:
    model = _model()
    _saved(tmp_path, optimizer=torch.optim.Adam(model.parameters()))
    save = next(tmp_path.iterdir())
    other = _model(1)
    two_groups = torch.optim.Adam(
        [{"params": other[0].parameters()}, {"params": other[2].parameters()}]
    )
    with (
        TrainingState(tmp_path, model=other, optimizer=two_groups) as state,
        pytest.raises(CheckpointError) as caught,
    ):
        state.resume()
    _said(
        caught.value,
        f"{save / saves.SHARED} holds an optimizer state that this optimizer cannot take: it "
        "has 1 parameter groups, this optimizer has 2.",
        "Resume with the optimizer the run saved (same kind, same parameters).",
    )


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (ValueError("a wrong value\nand more lines"), "ValueError: a wrong value"),
        (KeyError(), "KeyError: "),
        (RuntimeError("one line"), "RuntimeError: one line"),
    ],
)
def test_a_part_whose_loader_refuses_the_state_is_refused_with_the_first_line_of_why(
    tmp_path: Path, error: Exception, said: str
) -> None:
    save = _saved(tmp_path, loader=Counter())
    caught = _resume_error(tmp_path, loader=Refusing(error))
    _said(
        caught,
        f"{save} holds a loader state that this loader cannot take: {said}",
        "Resume with the loader the run saved (same kind, same parameters).",
    )


@pytest.mark.parametrize(
    ("name", "content", "what"),
    [
        (saves.SHARED, 5, "a mapping"),
        (saves.rank_file(0), 5, "rng"),
        (saves.rank_file(0), {"extras": {}}, "rng"),
    ],
)
def test_a_file_that_is_not_a_training_states_is_refused_naming_it(
    tmp_path: Path, name: str, content: object, what: str
) -> None:
    save = _saved(tmp_path)
    _rewrite(save, name, content)
    _said(
        _resume_error(tmp_path),
        f"{save / name} is not a training state's file: {what} is missing or malformed.",
        MALFORMED_HINT,
    )


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"step": "3"}, "the step"),
        ({"step": -1}, "the step"),
        ({"step": None}, "the step"),
        ({"sharded": "model"}, "the list of sharded parts"),
        ({"sharded": ["bogus"]}, "the list of sharded parts"),
        ({"sharded": ["model", "weights"]}, "the list of sharded parts"),
        ({"sharded": ["optimizer"]}, "the list of sharded parts"),  # no optimizer alone
        ({"sharded": ["optimizer", "model"]}, "the list of sharded parts"),
        ({"sharded": ("model",)}, "the list of sharded parts"),
        ({"sharded": ["model"]}, "the sharded part"),
        ({"sharded": ["model", "optimizer"]}, "the sharded part"),
    ],
)
def test_a_shared_part_with_a_malformed_field_is_refused_naming_the_field(
    tmp_path: Path, changes: dict[str, Any], what: str
) -> None:
    save = _saved(tmp_path)
    _changed_shared(save, **changes)
    _said(
        _resume_error(tmp_path),
        f"{save / saves.SHARED} is not a training state's file: {what} is missing or malformed.",
        MALFORMED_HINT,
    )


def test_a_shared_part_without_the_list_of_sharded_parts_resumes(tmp_path: Path) -> None:
    save = _saved(tmp_path)
    shared = torch.load(save / saves.SHARED, weights_only=True)
    assert shared["sharded"] == []
    del shared["sharded"]
    _rewrite(save, saves.SHARED, shared)
    with TrainingState(tmp_path, model=_model(1)) as state:
        assert state.resume() is not None
        assert state.step == 3


def test_saved_extras_that_are_not_a_mapping_are_refused(tmp_path: Path) -> None:
    save = _saved(tmp_path)
    _changed_shared(save, extras=[1])
    _said(
        _resume_error(tmp_path),
        f"{save} is not a training state's file: the extras is missing or malformed.",
        MALFORMED_HINT,
    )


@pytest.mark.parametrize("label", ["extras", "rank_extras"])
def test_an_extra_the_save_lacks_is_refused_naming_it(tmp_path: Path, label: str) -> None:
    save = _saved(tmp_path)
    _said(
        _resume_error(tmp_path, **{label: {"best": 0.0}}),
        f"{save} holds no extra named 'best'; this run has one.",
        "Resume with the extras the run saved, or start in another folder.",
    )


def test_random_streams_a_save_cannot_restore_are_refused_naming_the_save(tmp_path: Path) -> None:
    save = _saved(tmp_path)
    _rewrite(save, saves.rank_file(0), {"rng": {"python": 5}, "extras": {}})
    error = _resume_error(tmp_path)
    assert error.message.startswith(f"{save} holds random streams that gpukit cannot restore: ")


# --- a model sharded with FSDP2, in a group of this process alone -----------------------------


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(5, 5) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _sharded() -> tuple[nn.Module, torch.optim.Optimizer]:
    net = shard(Stack(), device=torch.device("cpu"), weight=lambda: 1.0)
    return net, torch.optim.AdamW(net.parameters(), lr=0.01)


def _trained_sharded(net: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        net(torch.ones(2, 5)).square().mean().backward()  # type: ignore[no-untyped-call]
        opt.step()


def _full(net: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in net.state_dict().items()
    }


def _moments(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
        for state in opt.state.values()
        for key, t in sorted(state.items())
        if key != "step"
    ]


@pytest.mark.usefixtures("group_of_one")
@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_sharded_model_and_its_optimizer_resume_exactly(
    tmp_path: Path, asynchronous: bool
) -> None:
    net, opt = _sharded()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with TrainingState(
        tmp_path, model=net, optimizer=opt, scheduler=sched, asynchronous=asynchronous
    ) as state:
        _trained_sharded(net, opt, 2)
        sched.step()
        saved = state.save()
        state.wait()
        state.close()  # a second close, after the shards' stager was let go
    shared = torch.load(saved / saves.SHARED, weights_only=True)
    assert shared["sharded"] == ["model", "optimizer"]
    assert "model" not in shared
    assert "optimizer" not in shared
    again, fresh = _sharded()
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh, step_size=1, gamma=0.5)
    with TrainingState(tmp_path, model=again, optimizer=fresh, scheduler=fresh_sched) as state:
        resumed = state.resume()
        assert resumed is not None
        assert (resumed.path, state.step) == (saved, 2)
    assert {k: v.tolist() for k, v in _full(again).items()} == {
        k: v.tolist() for k, v in _full(net).items()
    }
    assert [t.tolist() for t in _moments(fresh)] == [t.tolist() for t in _moments(opt)]
    assert fresh_sched.state_dict() == sched.state_dict()


@pytest.mark.usefixtures("group_of_one")
def test_an_asynchronous_save_of_a_sharded_model_holds_the_weights_of_its_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loop steps on while the save is written: what is written is what save() was given.
    held, run = threading.Event(), SaveJob.run

    def held_back(job: SaveJob) -> Path:
        assert held.wait(60), "the test never let the save be written"
        return run(job)

    monkeypatch.setattr(SaveJob, "run", held_back)
    net, opt = _sharded()
    with TrainingState(tmp_path, model=net, optimizer=opt, asynchronous=True) as state:
        _trained_sharded(net, opt, 1)
        at_save, moments = _full(net), _moments(opt)
        state.save()
        _trained_sharded(net, opt, 2)  # while the save waits to be written
        held.set()
        assert _full(net)["blocks.0.weight"].tolist() != at_save["blocks.0.weight"].tolist()
        state.wait()
    monkeypatch.setattr(SaveJob, "run", run)
    again, fresh = _sharded()
    with TrainingState(tmp_path, model=again, optimizer=fresh) as state:
        assert state.resume() is not None
        assert state.step == 1
    assert {k: v.tolist() for k, v in _full(again).items()} == {
        k: v.tolist() for k, v in at_save.items()
    }
    assert [t.tolist() for t in _moments(fresh)] == [t.tolist() for t in moments]


@pytest.mark.usefixtures("group_of_one")
def test_a_sharded_model_saved_before_its_first_step_is_saved_at_step_0(tmp_path: Path) -> None:
    net, opt = _sharded()
    with TrainingState(tmp_path, model=net, optimizer=opt) as state:
        saved = state.save()
        assert state.step == 0
        _trained_sharded(net, opt, 1)
        assert state.step == 1
    assert saved.name.startswith("step-000000000-")


@pytest.mark.usefixtures("group_of_one")
def test_a_sharded_model_without_an_optimizer_resumes_its_weights(tmp_path: Path) -> None:
    net, _ = _sharded()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    _saved_by = TrainingState(tmp_path, model=net, asynchronous=False)
    with _saved_by as state:
        state.save()
    again, opt = _sharded()
    with (
        TrainingState(tmp_path, model=again, optimizer=opt) as state,
        pytest.raises(CheckpointError, match="holds no optimizer state"),
    ):
        state.resume()
    again, _ = _sharded()
    with TrainingState(tmp_path, model=again) as state:
        assert state.resume() is not None
    assert {k: v.tolist() for k, v in _full(again).items()} == {
        k: v.tolist() for k, v in _full(net).items()
    }


@pytest.mark.usefixtures("group_of_one")
def test_an_unsharded_save_resumes_into_a_sharded_model_and_its_optimizer(tmp_path: Path) -> None:
    plain = Stack()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    with TrainingState(tmp_path, model=plain, optimizer=plain_opt, asynchronous=False) as state:
        _trained_sharded(plain, plain_opt, 2)
        state.save()
    net, opt = _sharded()
    with TrainingState(tmp_path, model=net, optimizer=opt) as state:
        assert state.resume() is not None
        assert state.step == 2
    assert {k: v.tolist() for k, v in _full(net).items()} == {
        k: v.tolist() for k, v in _full(plain).items()
    }
    assert [t.tolist() for t in _moments(opt)] == [t.tolist() for t in _moments(plain_opt)]
    # the moments are the sharded optimizer's own, shards of the model's: it steps on
    _trained_sharded(plain, plain_opt, 1)
    _trained_sharded(net, opt, 1)
    assert {k: v.tolist() for k, v in _full(net).items()} == {
        k: v.tolist() for k, v in _full(plain).items()
    }


@pytest.mark.usefixtures("group_of_one")
def test_an_unsharded_save_without_an_optimizer_is_refused_to_a_sharded_run_with_one(
    tmp_path: Path,
) -> None:
    save = _saved(tmp_path)
    net = shard(_model(1), device=torch.device("cpu"), weight=lambda: 1.0)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    with (
        TrainingState(tmp_path, model=net, optimizer=opt) as state,
        pytest.raises(CheckpointError) as caught,
    ):
        state.resume()
    _said(
        caught.value,
        f"{save} holds no optimizer state, and this run has an optimizer.",
        "Resume without an optimizer, or from a save of a run that had one.",
    )


@pytest.mark.usefixtures("group_of_one")
def test_an_unsharded_optimizer_state_a_sharded_one_cannot_take_is_refused(
    tmp_path: Path,
) -> None:
    plain = Stack()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    with TrainingState(tmp_path, model=plain, optimizer=plain_opt, asynchronous=False) as state:
        _trained_sharded(plain, plain_opt, 1)
        saved = state.save()
    net, _ = _sharded()
    two_groups = torch.optim.AdamW(
        [{"params": net.blocks[0].parameters()}, {"params": net.blocks[1].parameters()}]
    )
    with (
        TrainingState(tmp_path, model=net, optimizer=two_groups) as state,
        pytest.raises(CheckpointError) as caught,
    ):
        state.resume()
    _said(
        caught.value,
        f"{saved / saves.SHARED} holds an optimizer state that this optimizer cannot take: it "
        "has 1 parameter groups, this optimizer has 2.",
        "Resume with the optimizer the run saved (same kind, same parameters).",
    )


@pytest.mark.usefixtures("group_of_one")
def test_a_sharded_save_resumes_into_an_unsharded_model(tmp_path: Path) -> None:
    net, opt = _sharded()
    with TrainingState(tmp_path, model=net, optimizer=opt) as state:
        _trained_sharded(net, opt, 2)
        state.save()
    plain = Stack()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    with TrainingState(tmp_path, model=plain, optimizer=plain_opt) as state:
        assert state.resume() is not None
    assert {k: v.tolist() for k, v in _full(plain).items()} == {
        k: v.tolist() for k, v in _full(net).items()
    }
    assert [t.tolist() for t in _moments(plain_opt)] == [t.tolist() for t in _moments(opt)]
