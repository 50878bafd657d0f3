"""What a training state accepts as its parts and extras, and what a staged copy holds.

The refusals a user meets at ``TrainingState(...)`` (a part without both halves of torch's
state-dict convention, extras a save could not read back as data, extras nested too deep),
each asserted whole; then the staged copy: every tensor its own values save after save, the
buffers of tensors in lists reused, and, on a GPU, a copy that is complete and pinned when
``stage`` returns.
"""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gpukit.errors import InvalidArgumentError
from gpukit.train import TrainingState
from gpukit.train._staging import Stager

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_a_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")

_NOT_DATA_HINT = (
    "Pass an object with state_dict()/load_state_dict(), or plain data (numbers, strings, "
    "tensors, and lists and dicts of them)."
)

Pair = namedtuple("Pair", ["low", "high"])


class Settings(dict):  # type: ignore[type-arg]
    """A dict of the user's own class: a save would need that class to read it back."""


class SavesOnly:
    """Half of torch's convention: a state to save, no way to load it back."""

    def state_dict(self) -> dict[str, int]:
        return {"count": 1}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def _refusal(tmp_path: Path, extras: dict[str, Any]) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as caught:
        TrainingState(tmp_path, model=_model(), extras=extras)
    return caught.value


def _nested(depth: int, inner: str) -> Any:
    """A value ``depth`` containers deep (lists, or dicts under the key "k") around a 0."""
    value: Any = 0
    for _ in range(depth):
        value = [value] if inner == "list" else {"k": value}
    return value


# --- what TrainingState accepts --------------------------------------------------------------


def test_a_part_with_state_dict_but_no_load_state_dict_is_refused_naming_the_slot(
    tmp_path: Path,
) -> None:
    with pytest.raises(InvalidArgumentError, match=r"scheduler=SavesOnly, which has no"):
        TrainingState(tmp_path, model=_model(), scheduler=SavesOnly())


@pytest.mark.parametrize("inner", ["list", "dict"])
def test_extras_nested_32_deep_are_accepted(tmp_path: Path, inner: str) -> None:
    with TrainingState(tmp_path, model=_model(), extras={"x": _nested(32, inner)}) as state:
        assert state.extras["x"] == _nested(32, inner)


@pytest.mark.parametrize(("inner", "step"), [("list", "[0]"), ("dict", "['k']")])
def test_extras_nested_33_deep_are_refused_naming_where(
    tmp_path: Path, inner: str, step: str
) -> None:
    refused = _refusal(tmp_path, {"x": _nested(33, inner)})
    assert (refused.message, refused.hint) == (
        f"extras['x']{step * 33} is nested more than 32 deep.",
        "Save flatter data.",
    )


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (np.float64(0.5), "float64"),  # a float, for isinstance; numpy's, for the reader
        (Pair(1, 2), "Pair"),  # a tuple of the user's own class
        (Settings(lr=0.1), "Settings"),  # a dict of the user's own class
    ],
)
def test_extras_of_a_subclass_of_a_plain_type_are_refused_naming_the_type(
    tmp_path: Path, value: Any, kind: str
) -> None:
    refused = _refusal(tmp_path, {"x": value})
    assert (refused.message, refused.hint) == (
        f"extras['x'] is a {kind}, which a training state cannot save as data.",
        _NOT_DATA_HINT,
    )


def test_a_refused_value_deep_in_lists_and_dicts_is_named_by_its_path(tmp_path: Path) -> None:
    refused = _refusal(tmp_path, {"x": [0, {"a": 1, "k": [2, print]}]})
    assert refused.message == (
        "extras['x'][1]['k'][1] is a builtin_function_or_method, which a training state "
        "cannot save as data."
    )


def test_a_key_that_is_not_a_string_deep_in_extras_is_refused_naming_where(
    tmp_path: Path,
) -> None:
    refused = _refusal(tmp_path, {"x": [{"a": {1: "v"}}]})
    assert (refused.message, refused.hint) == (
        "extras['x'][0]['a'] has the key 1, not a string.",
        "Use str keys.",
    )


# --- what a staged copy holds ----------------------------------------------------------------


def test_tensors_of_the_same_shape_each_keep_their_own_values_save_after_save() -> None:
    stager = Stager()
    state = {"a": torch.full((3,), 1.0), "b": torch.full((3,), 2.0)}
    stager.stage(state)
    again = stager.stage(state)
    assert torch.equal(again["a"], torch.full((3,), 1.0))
    assert torch.equal(again["b"], torch.full((3,), 2.0))


def test_tensors_in_lists_and_tuples_are_copied_into_the_buffers_of_the_staging_before() -> None:
    stager = Stager()
    state = {"l": [torch.ones(100)], "t": (torch.ones(100),)}
    first = stager.stage(state)
    state["l"][0].fill_(2.0)
    state["t"][0].fill_(2.0)
    second = stager.stage(state)
    assert second["l"][0].data_ptr() == first["l"][0].data_ptr()
    assert second["t"][0].data_ptr() == first["t"][0].data_ptr()
    assert torch.all(second["l"][0] == 2.0)
    assert torch.all(second["t"][0] == 2.0)


def test_a_list_of_tensors_still_in_the_autograd_graph_is_staged_detached() -> None:
    weight = torch.ones(3, requires_grad=True)
    losses = [weight * 2.0]  # an extra a loop may keep: its recent losses, not yet detached
    staged = Stager().stage({"losses": losses})
    assert torch.equal(staged["losses"][0], torch.full((3,), 2.0))
    assert not staged["losses"][0].requires_grad


# --- on a GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_a_gpu
def test_a_state_staged_from_a_gpu_is_in_pinned_host_memory() -> None:
    staged = Stager().stage({"w": torch.ones(1000, device="cuda")})
    assert staged["w"].device.type == "cpu"
    assert staged["w"].is_pinned()


@pytest.mark.gpu
@needs_a_gpu
def test_a_state_staged_from_a_gpu_holds_its_values_when_stage_returns() -> None:
    stager = Stager()
    weights = torch.ones(1 << 24, device="cuda")
    stager.stage({"w": weights})  # the next staging copies into this one's buffer
    weights.fill_(2.0)
    torch.cuda._sleep(1 << 30)  # type: ignore[no-untyped-call]  # the copy queues behind it
    staged = stager.stage({"w": weights})
    assert bool(torch.all(staged["w"] == 2.0))
