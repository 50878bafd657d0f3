"""The main job: gk's demo trains over several replicas, saves, reloads, and is reproducible."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpukit as gk
from gpukit.demo import DemoConfig, DemoEvent, DemoResult, DigitsNet, run_demo
from gpukit.errors import InvalidArgumentError


@pytest.fixture(scope="module")
def full_run() -> tuple[DemoResult, list[DemoEvent]]:
    events: list[DemoEvent] = []
    return run_demo(DemoConfig(devices=("cpu",) * 4), events.append), events


def test_demo_reaches_95_percent_on_held_out_digits(
    full_run: tuple[DemoResult, list[DemoEvent]],
) -> None:
    result, _ = full_run
    assert result.test_accuracy >= 0.95


def test_reloaded_plain_model_scores_exactly_the_same(
    full_run: tuple[DemoResult, list[DemoEvent]],
) -> None:
    result, _ = full_run
    assert result.reloaded_accuracy == result.test_accuracy


def test_first_step_shows_each_replicas_share_of_a_batch_of_16(
    full_run: tuple[DemoResult, list[DemoEvent]],
) -> None:
    result, events = full_run
    assert result.replica_batch_sizes == [4, 4, 4, 4]
    assert result.gathered_output_shape == [16, 10]
    kinds = [e.kind for e in events]
    assert kinds[:2] == ["plan", "first_step"]
    assert kinds.count("epoch") == result.epochs
    assert kinds[-2:] == ["saved", "reloaded"]


def test_same_seed_gives_the_same_result() -> None:
    config = DemoConfig(devices=("cpu",) * 2, epochs=1, seed=3)
    first, second = run_demo(config), run_demo(config)
    assert first.epoch_losses == second.epoch_losses
    assert first.test_accuracy == second.test_accuracy


def test_uneven_replica_count_still_trains() -> None:
    result = run_demo(DemoConfig(devices=("cpu",) * 3, epochs=1))
    assert result.replica_batch_sizes == [6, 5, 5]
    assert result.epoch_losses[0] < 2.3  # below chance level (ln 10)


def test_checkpoint_can_be_kept_and_loads_into_a_plain_model(tmp_path: Path) -> None:
    path = tmp_path / "digits.pt"
    result = run_demo(DemoConfig(devices=("cpu",), epochs=1, checkpoint=str(path)))
    assert result.checkpoint == str(path)
    report = gk.load(DigitsNet(), path)
    assert not report.missing
    assert not report.unexpected


def test_demo_leaves_global_random_state_as_it_found_it() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    run_demo(DemoConfig(devices=("cpu",), epochs=1))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("field", ["epochs", "batch_size"])
def test_nonsense_settings_are_rejected(field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        DemoConfig(**{field: 0})  # type: ignore[arg-type]


def test_demo_reaches_its_accuracy_in_bf16_with_four_micro_batches_a_step() -> None:
    result = run_demo(DemoConfig(devices=("cpu",) * 2, precision="bf16-mixed", accumulate=4))
    assert result.test_accuracy >= 0.95
    assert result.extra == {"precision": "bf16-mixed", "accumulate": 4, "skipped_steps": 0}


def test_micro_batches_give_the_losses_of_whole_batches_in_fp32() -> None:
    # 1,437 training digits in batches of 64 end with a batch of 29: cut in 4, the parts hold
    # 8, 7, 7, 7 samples, and only weighing them by samples gives the whole batch's step.
    whole = run_demo(DemoConfig(devices=("cpu",), epochs=2))
    parts = run_demo(DemoConfig(devices=("cpu",), epochs=2, accumulate=4))
    assert parts.epoch_losses == pytest.approx(whole.epoch_losses, rel=1e-4)


def test_more_micro_batches_than_samples_in_a_batch_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="more micro-batches than it has samples"):
        DemoConfig(batch_size=8, accumulate=9)
