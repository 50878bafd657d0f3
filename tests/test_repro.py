"""gk.seed_everything: seeds, switches, and putting them back."""

from __future__ import annotations

import logging
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
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    previous = gk.seed_everything(0, deterministic=True)
    assert previous.cudnn_benchmark is True
    assert previous.deterministic_algorithms is False


def test_context_manager_restores_switches_and_random_state() -> None:
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    torch.use_deterministic_algorithms(False)
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


# -- the seed from the environment ---------------------------------------------------------------


def test_no_seed_reads_gpukit_seed_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("GPUKIT_SEED", "123")
    with caplog.at_level(logging.INFO, logger="gpukit.repro"):
        settings = gk.seed_everything()
    assert (settings.seed, settings.seed_source) == (123, "GPUKIT_SEED")
    assert "seed 123 (from GPUKIT_SEED)" in caplog.text
    drawn = _draw()
    gk.seed_everything(123)
    assert _draw() == drawn


def test_no_seed_and_no_gpukit_seed_means_zero_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("GPUKIT_SEED", raising=False)
    with caplog.at_level(logging.INFO, logger="gpukit.repro"):
        settings = gk.seed_everything()
    assert (settings.seed, settings.seed_source) == (0, "default")
    assert "seed 0 (GPUKIT_SEED is not set)" in caplog.text


def test_an_explicit_seed_wins_over_gpukit_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_SEED", "5")
    settings = gk.seed_everything(9)
    assert (settings.seed, settings.seed_source) == (9, "argument")


@pytest.mark.parametrize("value", ["abc", "1.5", "-3", str(2**32)])
def test_a_gpukit_seed_that_is_no_valid_seed_is_a_typed_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("GPUKIT_SEED", value)
    with pytest.raises(InvalidArgumentError, match="GPUKIT_SEED"):
        gk.seed_everything()


@pytest.mark.parametrize("switch", ["deterministic", "benchmark"])
def test_switches_that_are_not_bools_are_refused(switch: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"{switch}='no'"):
        gk.seed_everything(0, **{switch: "no"})  # type: ignore[arg-type]


# -- DataLoader workers --------------------------------------------------------------------------


class _Draws(torch.utils.data.Dataset[tuple[float, float, float]]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(torch.rand(1))


def _worker_draws(seed: int) -> list[tuple[float, float, float]]:
    loader = torch.utils.data.DataLoader(
        _Draws(),
        batch_size=None,
        num_workers=2,
        worker_init_fn=gk.seed_worker,
        generator=torch.Generator().manual_seed(seed),
        multiprocessing_context="fork",
    )
    return [tuple(float(v) for v in item) for item in loader]  # type: ignore[misc]


@pytest.mark.slow
def test_seed_worker_seeds_every_generator_from_the_workers_own_torch_seed() -> None:
    # torch gives worker w the seed base + w, base drawn from the loader's generator.
    base = int(
        torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(3))
    )
    draws = _worker_draws(3)
    for worker, got in enumerate(draws):  # item w comes from worker w (round robin)
        seed = base + worker
        folded = (seed ^ (seed >> 32)) & (2**32 - 1)
        expected_torch = float(torch.rand(1, generator=torch.Generator().manual_seed(seed)))
        assert got == (
            random.Random(seed).random(),
            float(np.random.RandomState(folded).rand()),
            expected_torch,
        )
    assert draws[0][1] != draws[1][1]


def test_seed_worker_outside_a_worker_is_a_typed_error() -> None:
    with pytest.raises(InvalidArgumentError, match="outside a DataLoader worker"):
        gk.seed_worker(0)
