"""gk.load reads the files people have, and never guesses which of two models to load.

Old torch files (the pickle format torch wrote before 1.6, still written with
``_use_new_zipfile_serialization=False``) load like new ones. A file holding two competing state
dicts under names gk.load does not know (a student and its teacher, say) is refused with a typed
error naming both, rather than loading whichever comes first.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.errors import CheckpointError


def _linear(fill: float) -> nn.Linear:
    layer = nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.fill_(fill)
        layer.bias.fill_(fill)
    return layer


def _weights(layer: nn.Module) -> list[float]:
    return [float(v) for v in torch.cat([p.detach().flatten() for p in layer.parameters()])]


# -- the old (non-zip) torch format -------------------------------------------------------------


def test_a_checkpoint_in_the_old_non_zip_torch_format_loads(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    torch.save(_linear(0.5).state_dict(), path, _use_new_zipfile_serialization=False)
    assert not path.read_bytes().startswith(b"PK")  # really the legacy pickle format
    model = _linear(0.0)
    report = gk.load(model, path)
    assert report.ok
    assert report.format == "torch"
    assert report.loaded == ["weight", "bias"]
    assert _weights(model) == [0.5] * 8


def test_an_old_format_checkpoint_of_a_data_parallel_model_loads_into_the_bare_model(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old_dp.pth"
    wrapped = nn.DataParallel(_linear(2.0))
    torch.save(
        {"state_dict": wrapped.state_dict(), "epoch": 7}, path, _use_new_zipfile_serialization=False
    )
    model = _linear(0.0)
    report = gk.load(model, path)
    assert report.container_key == "state_dict"
    assert report.extras == {"epoch": 7}
    assert _weights(model) == [2.0] * 8


# -- two competing state dicts ------------------------------------------------------------------


def test_a_file_with_a_student_and_a_teacher_is_refused_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "distill.pt"
    torch.save({"student": _linear(1.0).state_dict(), "teacher": _linear(9.0).state_dict()}, path)
    model = _linear(0.0)
    with pytest.raises(CheckpointError) as info:
        gk.load(model, path)
    assert "'student'" in info.value.message
    assert "'teacher'" in info.value.message
    assert info.value.exit_code == 2  # bad input, as `gpukit ckpt` reports it
    assert _weights(model) == [0.0] * 8  # nothing loaded


def test_refusing_two_state_dicts_does_not_depend_on_their_order(tmp_path: Path) -> None:
    path = tmp_path / "distill.pt"
    entries = OrderedDict(
        [("teacher", _linear(9.0).state_dict()), ("student", _linear(1.0).state_dict())]
    )
    torch.save(entries, path)
    with pytest.raises(CheckpointError, match=r"'teacher'.*'student'"):
        gk.load(_linear(0.0), path)


def test_one_state_dict_beside_other_entries_is_found_under_any_name(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    torch.save({"student": _linear(1.0).state_dict(), "step": 10}, path)
    model = _linear(0.0)
    report = gk.load(model, path)
    assert report.container_key == "student"
    assert _weights(model) == [1.0] * 8


def test_a_known_container_name_wins_over_another_state_dict(tmp_path: Path) -> None:
    # "model" is one of the names gk.load looks for first (CONTAINER_KEYS): not a guess.
    path = tmp_path / "ema.pt"
    torch.save({"ema": _linear(5.0).state_dict(), "model": _linear(1.0).state_dict()}, path)
    model = _linear(0.0)
    assert gk.load(model, path).container_key == "model"
    assert _weights(model) == [1.0] * 8
