"""gk.TrainingState in a gloo group of two, this process rank 0: the save both ranks make, the
save both take back (rank 0 chooses), each rank's own random streams and extras, and what is
logged and warned.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from gpukit.train import TrainingState
from tests.helpers.two_processes import OtherRank, two_processes


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2)).double()


def save_then_resume(rank: int, folder: str) -> dict[str, Any]:
    """Save at step 3 (each rank its own streams and rank extras), scramble everything, resume;
    what the save was named, what the resume took, the streams after it and the extras."""
    torch.manual_seed(100 + rank)
    with TrainingState(
        folder, model=_model(), rank_extras={"rank": rank}, asynchronous=False
    ) as state:
        state.step = 3
        name = state.save().name
    expected = torch.rand(2).tolist()  # the streams as saved, drawn from
    torch.manual_seed(999)
    with TrainingState(folder, model=_model(), rank_extras={"rank": None}) as state:
        resumed = state.resume()
        assert resumed is not None
        return {
            "name": name,
            "taken": resumed.path.name,
            "step": state.step,
            "world_size": resumed.world_size,
            "streams_back": torch.rand(2).tolist() == expected,
            "rank_extras": state.rank_extras,
        }


def save_and_resume_alike(rank: int, folder: str) -> str:
    """Save (in the background) with extras, then resume, on one state; the save's name."""
    del rank
    with TrainingState(folder, model=_model(), extras={"lr": 0.1}) as state:
        name = state.save().name
        state.wait()
        resumed = state.resume()
        assert resumed is not None
        return resumed.path.name if resumed.path.name == name else "another save"


def resume_nothing(rank: int, folder: str) -> Any:
    del rank
    with TrainingState(folder, model=_model()) as state:
        return state.resume()


def save_with_extras(rank: int, folder: str, extras: dict[str, Any]) -> str:
    del rank
    with TrainingState(folder, model=_model(), extras=extras, asynchronous=False) as state:
        return state.save().name


@pytest.fixture(scope="module")
def other_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as other:
        yield other


def test_both_ranks_save_under_one_name_and_resume_it_each_with_its_own_streams(
    other_rank: OtherRank, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other_rank.run(save_then_resume, str(tmp_path))
    with caplog.at_level(logging.INFO, logger="gpukit.train"):
        mine = save_then_resume(0, str(tmp_path))
    theirs = other_rank.result()
    assert re.fullmatch(r"step-000000003-[0-9a-f]{12}-0", mine["name"]), mine
    assert theirs["name"] == mine["name"]
    for rank, found in enumerate((mine, theirs)):
        assert found["taken"] == mine["name"]
        assert (found["step"], found["world_size"]) == (3, 2)
        assert found["streams_back"], f"rank {rank} did not get its own streams back"
        assert found["rank_extras"] == {"rank": rank}
    said = [r.getMessage() for r in caplog.records if r.name == "gpukit.train"]
    assert said == [f"resumed from {tmp_path / mine['name']} (step 3, saved by 2 processes)"]


def test_both_ranks_start_afresh_where_there_is_no_save(
    other_rank: OtherRank, tmp_path: Path
) -> None:
    other_rank.run(resume_nothing, str(tmp_path))
    assert resume_nothing(0, str(tmp_path)) is None
    assert other_rank.result() is None


def test_extras_that_differ_between_the_ranks_are_named_in_one_whole_warning(
    other_rank: OtherRank, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other_rank.run(save_with_extras, str(tmp_path), {"best": 2.0, "lr": 0.1})
    with caplog.at_level(logging.WARNING, logger="gpukit.train"):
        here = save_with_extras(0, str(tmp_path), {"best": 1.0, "lr": 0.1})
    assert other_rank.result() == here
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        "extras 'best' differ between the ranks, and only rank 0's are saved: a resumed run "
        "gives every rank rank 0's. Pass what differs per rank in rank_extras= (saved by each "
        "rank)."
    ]


def test_saves_and_resumes_meet_only_in_their_own_group_not_the_training_loops(
    other_rank: OtherRank, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer thread meets the other ranks while the loop goes on: in the default group
    # its collectives would interleave with the loop's own.
    groups: list[Any] = []
    for name in ("broadcast_object_list", "all_gather_object", "all_reduce", "barrier"):
        collective = getattr(tdist, name)

        def noted(*args: Any, _collective: Any = collective, **kwargs: Any) -> Any:
            groups.append(kwargs.get("group"))
            return _collective(*args, **kwargs)

        monkeypatch.setattr(tdist, name, noted)
    other_rank.run(save_and_resume_alike, str(tmp_path))
    here = save_and_resume_alike(0, str(tmp_path))
    assert other_rank.result() == here
    assert len(groups) >= 4  # the token, the extras' digests, the save's meeting, the choice
    assert all(group is not None and group is not tdist.group.WORLD for group in groups)
    assert len({id(group) for group in groups}) == 1
