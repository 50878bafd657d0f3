"""What a save's parts must be before their loaders see them, and the reason each refusal gives.

:mod:`gpukit.train.contents` checks a saved optimizer or scheduler state against the live one,
and a ``torch.save`` file's zip records, before torch reads them; the training state shows the
reason in its ``CheckpointError``. The checks are called here directly, with states torch writes
and the ones a changed save could hold.
"""

from __future__ import annotations

import copy
import io
import math
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpukit.errors import CheckpointError
from gpukit.train import TrainingState, contents
from gpukit.train.contents import check_optimizer_state, check_records, check_scheduler_state
from gpukit.untrusted import InvalidInput


def _adam() -> torch.optim.Optimizer:
    """An Adam optimizer of one group of two parameters (a weight and a bias)."""
    torch.manual_seed(0)
    return torch.optim.Adam(nn.Linear(3, 2).parameters(), lr=0.01)


def _refused(what: str) -> Any:
    """``pytest.raises`` for an ``InvalidInput`` whose message is ``what``, whole."""
    return pytest.raises(InvalidInput, match=f"^{re.escape(what)}$")


def _group(change: Callable[[dict[str, Any]], object]) -> Callable[[dict[str, Any]], object]:
    """A change to the saved optimizer state's only parameter group."""

    def changed(saved: dict[str, Any]) -> object:
        change(saved["param_groups"][0])
        return saved

    return changed


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda group: group.update({key: value})


# --- the optimizer's state -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda saved: 7, "it is not a mapping"),
        (lambda saved: {**saved, "state": []}, "its 'state' is not a mapping"),
        (
            lambda saved: {**saved, "param_groups": tuple(saved["param_groups"])},
            "its 'param_groups' is not a list",
        ),
        (
            lambda saved: {**saved, "param_groups": []},
            "it has 0 parameter groups, this optimizer has 1",
        ),
        (
            lambda saved: {**saved, "param_groups": [5]},
            "its parameter group 0 is not a mapping with 'params'",
        ),
        (
            _group(_set("params", [0])),
            "its parameter group 0 has 1 parameters, this optimizer's has 2",
        ),
        (_group(_set("params", [1, 1])), "its parameter group 0 names a parameter twice"),
        (_group(lambda group: group.pop("lr")), "its parameter group 0 has no learning rate"),
        (_group(_set(5, 0.1)), "its parameter group 0 has a key that is not text"),
    ],
    ids=[
        "not-a-mapping",
        "state-a-list",
        "groups-a-tuple",
        "no-group",
        "group-a-number",
        "one-parameter-of-two",
        "a-parameter-twice",
        "no-learning-rate",
        "a-key-not-text",
    ],
)
def test_an_optimizer_state_shaped_unlike_the_live_optimizer_is_refused_saying_how(
    change: Callable[[dict[str, Any]], object], reason: str
) -> None:
    optimizer = _adam()
    with _refused(reason):
        check_optimizer_state(change(optimizer.state_dict()), optimizer)


def test_a_parameter_named_by_anything_but_its_index_is_refused() -> None:
    optimizer = _adam()
    saved = optimizer.state_dict()
    saved["param_groups"][0]["params"] = ["0", 1]
    with pytest.raises(InvalidInput, match=r"^its parameter group 0 names a parameter by str, not"):
        check_optimizer_state(saved, optimizer)
    saved["param_groups"][0]["params"] = [1, 1]
    with pytest.raises(InvalidInput, match=r"^its parameter group 0 names a parameter twice$"):
        check_optimizer_state(saved, optimizer)


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("amsgrad", "yes", "is not a bool"),
        ("amsgrad", 1, "is not a bool"),
        ("lr", "fast", "is not a number"),
        ("lr", torch.tensor([0.1, 0.2]), "is not a number"),
        ("weight_decay", math.inf, "is not finite"),
        ("weight_decay", math.nan, "is not finite"),
        ("betas", 0.9, "is not a list"),
        ("betas", [0.9], "has 1 items, this one has 2"),
        ("betas", ("fast", 0.999), "is not a number"),
    ],
)
def test_a_setting_of_another_kind_than_the_live_groups_is_refused_naming_it(
    key: str, value: object, reason: str
) -> None:
    optimizer = _adam()
    saved = optimizer.state_dict()
    saved["param_groups"][0][key] = value
    with _refused(f"its parameter group 0's {key!r} {reason}"):
        check_optimizer_state(saved, optimizer)


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ({5: {}}, "its 'state' holds a parameter that no group names"),
        ({0: 5}, "a parameter's state is not a mapping"),
        ({0: {1: torch.zeros(1)}}, "a parameter's state is not a mapping"),
    ],
    ids=["unnamed-parameter", "state-a-number", "keys-not-text"],
)
def test_a_per_parameter_state_unlike_torchs_is_refused_saying_how(
    state: dict[Any, Any], reason: str
) -> None:
    optimizer = _adam()
    saved = optimizer.state_dict()
    saved["state"] = state
    with _refused(reason):
        check_optimizer_state(saved, optimizer)


def test_a_learning_rate_saved_as_a_one_element_tensor_is_taken() -> None:
    optimizer = _adam()
    saved = optimizer.state_dict()
    saved["param_groups"][0]["lr"] = torch.tensor(0.02)
    check_optimizer_state(saved, optimizer)
    optimizer.load_state_dict(saved)
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(0.02)


def test_a_fractional_setting_where_the_live_optimizer_has_a_whole_number_is_taken() -> None:
    # SGD's defaults are the integer 0; the run saved momentum 0.9 and weight decay 1e-4.
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ran = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    live = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = ran.state_dict()
    check_optimizer_state(saved, live)
    live.load_state_dict(saved)
    assert live.param_groups[0]["momentum"] == 0.9


def test_the_reason_for_refusing_an_optimizer_state_reaches_the_resume_error(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with TrainingState(tmp_path, model=model, optimizer=optimizer, asynchronous=False) as state:
        state.save()
    other = torch.optim.Adam(
        [{"params": [model.weight]}, {"params": [model.bias]}], lr=0.01
    )  # two groups where the run had one
    with (
        TrainingState(tmp_path, model=model, optimizer=other) as state,
        pytest.raises(
            CheckpointError,
            match="cannot take: it has 1 parameter groups, this optimizer has 2",
        ),
    ):
        state.resume()


# --- the scheduler's state -------------------------------------------------------------------


def _step_lr() -> Any:
    return torch.optim.lr_scheduler.StepLR(_adam(), step_size=2)


@pytest.mark.parametrize(
    ("saved", "reason"),
    [
        ([], "it is not a mapping"),
        ({"extra": 1}, "it has a key 'extra' that this scheduler's state lacks"),
        ({5: 1}, "it has a key 5 that this scheduler's state lacks"),
        ({(1, 2): 1}, "it has a key of type tuple that this scheduler's state lacks"),
        ({2.5: 1}, "it has a key of type float that this scheduler's state lacks"),
        ({"last_epoch": "x"}, "its 'last_epoch' is not a number"),
        ({"last_epoch": math.inf}, "its 'last_epoch' is not finite"),
    ],
    ids=[
        "a-list",
        "unknown-key",
        "a-number-key",
        "a-tuple-key",
        "a-float-key",
        "step-as-text",
        "step-infinite",
    ],
)
def test_a_scheduler_state_unlike_the_live_schedulers_is_refused_saying_how(
    saved: object, reason: str
) -> None:
    with _refused(reason):
        check_scheduler_state(saved, _step_lr())


def test_a_long_unknown_scheduler_key_is_shown_cut_to_sixty_characters() -> None:
    key = "k" * 100
    shown = repr(key)[:60]
    with _refused(f"it has a key {shown} that this scheduler's state lacks"):
        check_scheduler_state({key: 1}, _step_lr())


def test_a_plateau_scheduler_saved_before_its_first_step_is_taken() -> None:
    # Its best value is infinite until a step has seen a loss; its floor was set to a fraction
    # where the live scheduler's default is the integer 0.
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    ran = plateau(torch.optim.SGD(model.parameters(), lr=0.1), min_lr=1e-6)
    saved = ran.state_dict()
    assert saved["best"] == math.inf
    live = plateau(torch.optim.SGD(model.parameters(), lr=0.1))
    check_scheduler_state(saved, live)
    live.load_state_dict(saved)
    assert live.min_lrs == [1e-6]


def _sequential() -> Any:
    optimizer = _adam()
    first = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    then = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [first, then], milestones=[2])


def test_a_sequence_of_schedulers_is_taken_with_each_ones_own_state() -> None:
    check_scheduler_state(_sequential().state_dict(), _sequential())


def test_a_sequence_of_schedulers_whose_parts_are_not_states_is_refused() -> None:
    saved = copy.deepcopy(_sequential().state_dict())
    saved["_schedulers"] = [5, 5]
    with _refused("its '_schedulers' is not a mapping"):
        check_scheduler_state(saved, _sequential())


# --- the zip records of a torch.save file ----------------------------------------------------


def _saved_file(tmp_path: Path, records: int = 1) -> Path:
    path = tmp_path / "part.pt"
    torch.save({f"t{n}": torch.arange(4) for n in range(records)}, path)
    return path


def _first_entry(data: bytearray) -> int:
    """Where the central directory's first entry starts."""
    return data.find(b"PK\x01\x02")


def test_a_compressed_record_is_refused_as_rewritten_by_another_program(tmp_path: Path) -> None:
    path = _saved_file(tmp_path)
    out = io.BytesIO()
    with (
        zipfile.ZipFile(path) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst,
    ):
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    path.write_bytes(out.getvalue())
    with _refused(
        "it holds a compressed record (torch.save writes them stored): it was rewritten by "
        "another program"
    ):
        check_records(path)


def test_a_record_claiming_more_bytes_than_the_whole_file_is_refused(tmp_path: Path) -> None:
    path = _saved_file(tmp_path)
    data = bytearray(path.read_bytes())
    entry = _first_entry(data)
    claim = (len(data) + 1).to_bytes(4, "little")  # stored: both sizes agree, and lie
    data[entry + 20 : entry + 24] = claim
    data[entry + 24 : entry + 28] = claim
    path.write_bytes(bytes(data))
    with _refused("a record claims more bytes than the file holds"):
        check_records(path)


def test_a_file_as_torch_save_writes_it_is_taken(tmp_path: Path) -> None:
    check_records(_saved_file(tmp_path, records=3))


def test_an_archive_with_as_many_records_as_the_limit_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _saved_file(tmp_path)
    with zipfile.ZipFile(path) as archive:
        records = len(archive.infolist())
    monkeypatch.setattr(contents, "_MAX_RECORDS", records)
    check_records(path)


def test_an_archive_with_more_records_than_the_limit_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _saved_file(tmp_path)
    with zipfile.ZipFile(path) as archive:
        records = len(archive.infolist())
    monkeypatch.setattr(contents, "_MAX_RECORDS", records - 1)
    with _refused(f"it has more than {records - 1} records"):
        check_records(path)
