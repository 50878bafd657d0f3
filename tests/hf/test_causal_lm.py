"""A Hugging Face causal LM trained under gpukit in one process: exact token weighting against
one process on the whole batch, resumed bitwise, exported and reopened with from_pretrained.

The jobs are in ``workloads.py`` (``test_causal_lm_two_processes.py`` runs them on two
processes). Skipped, saying why, without transformers (the ``hf`` extra; CI installs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install -e '.[hf]' runs these"
)

from tests.hf import workloads as work

pytestmark = [pytest.mark.slow, pytest.mark.cpu_workers]


@pytest.fixture(scope="module")
def whole_batches() -> work.Weights:
    """One plain process on each global batch whole: what every run must end with."""
    return work.reference()


def test_one_process_accumulating_token_counts_ends_with_the_whole_batch_weights(
    whole_batches: work.Weights,
) -> None:
    # 2 micro-batches a step, each its own mean over its real tokens, weighed by its count.
    assert work.furthest(work.train(accumulate=2), whole_batches) <= work.TOLERANCE


def test_averaging_the_micro_batches_means_misses_the_whole_batch() -> None:
    # The bug transformers fixed in its Trainer in 2024: each micro-batch's mean weighs 1/K,
    # so a token of a short micro-batch counts more than one of a long one. Run beside the
    # test above, it shows that test can tell the two apart.
    whole = work.reference()
    assert work.furthest(work.train(accumulate=2, count=False), whole) > 1e-3


def test_the_models_own_float32_loss_agrees_to_float32_rounding() -> None:
    # transformers upcasts the logits to float32 for .loss, whatever the model's dtype, so a
    # run on model(**batch).loss agrees to ~1e-6 after its AdamW steps, not to 1e-12; the
    # per-micro-batch mean is 1e4 times further.
    whole = work.reference(hf_loss=True)
    assert work.furthest(work.train(accumulate=2, hf_loss=True), whole) <= 1e-5


def test_a_run_resumed_from_its_training_state_ends_bitwise_as_the_uninterrupted_one(
    tmp_path: Path,
) -> None:
    uninterrupted = work.train(accumulate=2)
    assert work.equal(work.train_with_state(0, str(tmp_path / "run")), uninterrupted)


def test_an_export_opens_with_from_pretrained_and_gives_the_same_logits(tmp_path: Path) -> None:
    trained = work.train_and_export(0, str(tmp_path / "hf"))
    loaded = work.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(work.logits(loaded), trained)
