"""gk.seed_everything: seeds, switches, and putting them back."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import gpukit as gk
from gpukit.errors import InvalidArgumentError


@pytest.fixture(autouse=True)
def _restore_global_state() -> Iterator[None]:
    saved = gk.seed_everything(0)
    saved_env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    saved.restore()
    if saved_env is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def _draw() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_same_seed_gives_the_same_numbers_everywhere() -> None:
    gk.seed_everything(123)
    first = _draw()
    gk.seed_everything(123)
    assert _draw() == first


def test_different_seeds_give_different_numbers() -> None:
    gk.seed_everything(1)
    first = _draw()
    gk.seed_everything(2)
    assert _draw() != first


def test_deterministic_turns_every_switch_on() -> None:
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    gk.seed_everything(0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_returns_the_settings_that_were_in_force_before() -> None:
    torch.backends.cudnn.benchmark = True
    previous = gk.seed_everything(0, deterministic=True)
    assert previous.cudnn_benchmark is True
    assert previous.deterministic_algorithms is False


def test_context_manager_restores_switches_and_random_state() -> None:
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    gk.seed_everything(7)
    expected_next = _draw()
    gk.seed_everything(7)
    with gk.seed_everything(99, deterministic=True):
        assert torch.are_deterministic_algorithms_enabled()
        torch.rand(100)
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert _draw() == expected_next


def test_benchmark_can_be_set_explicitly() -> None:
    gk.seed_everything(0, benchmark=True)
    assert torch.backends.cudnn.benchmark


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, "1", True])
def test_bad_seed_is_rejected(seed: object) -> None:
    with pytest.raises(InvalidArgumentError):
        gk.seed_everything(seed)  # type: ignore[arg-type]


def test_deterministic_with_benchmark_is_a_contradiction() -> None:
    with pytest.raises(InvalidArgumentError, match="autotuner"):
        gk.seed_everything(0, deterministic=True, benchmark=True)
