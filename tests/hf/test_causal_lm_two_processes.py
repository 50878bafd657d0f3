"""A Hugging Face causal LM trained under gpukit on two processes: exact token weighting with a
stand-in for the empty share, sharded by blocks with tied embeddings, exact mode with dropout,
resumed, exported from shards and reopened with from_pretrained, and trained on from there.

The test process is rank 0 of a real two-process gloo group (``tests/helpers/two_processes.py``);
the jobs both ranks run are in ``workloads.py``. What one process must end with is computed
before the group exists. Skipped, saying why, without transformers
(the ``hf`` extra; CI installs it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install -e '.[hf]' runs these"
)

from tests.helpers.two_processes import OtherRank, two_processes
from tests.hf import workloads as work

pytestmark = [pytest.mark.slow, pytest.mark.cpu_workers]


@pytest.fixture(scope="module")
def single() -> dict[str, work.Weights]:
    """One process: the whole global batches (no gpukit), and exact mode with dropout."""
    return {"whole": work.reference(), "exact": work.train(exact=True, dropout=0.1)}


@pytest.fixture(scope="module")
def other_rank(
    single: dict[str, work.Weights], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as other:
        yield other


def test_two_processes_accumulating_tokens_end_with_the_whole_batch_weights(
    single: dict[str, work.Weights], other_rank: OtherRank
) -> None:
    # The last step holds one sequence: rank 1 gets a stand-in there (the model cannot run on
    # 0 rows), weighed 0.
    other_rank.run(work.train, 2)
    mine = work.train(0, 2)
    assert work.furthest(mine, single["whole"]) <= work.TOLERANCE
    assert work.furthest(other_rank.result(), single["whole"]) <= work.TOLERANCE


def test_two_sharded_processes_with_a_block_policy_end_with_the_whole_batch_weights(
    single: dict[str, work.Weights], other_rank: OtherRank
) -> None:
    policy = [work.GPT2Block]  # the documented argument: one FSDP unit per block
    other_rank.run(work.train, 2, policy)
    mine = work.train(0, 2, policy)
    assert work.furthest(mine, single["whole"]) <= work.TOLERANCE
    assert work.furthest(other_rank.result(), single["whole"]) <= work.TOLERANCE


def test_sharding_keeps_the_output_layer_tied_to_the_input_embedding(
    other_rank: OtherRank,
) -> None:
    other_rank.run(work.tied_after_prepare)
    assert work.tied_after_prepare()
    assert other_rank.result()


def test_exact_mode_with_dropout_ends_bitwise_alike_on_one_and_two_processes(
    single: dict[str, work.Weights], other_rank: OtherRank
) -> None:
    # Micro-batches of 2: 4 a step on one process, 2 on each of two; dropout 0.1 draws each
    # micro-batch's masks from its place in the data.
    one = single["exact"]
    other_rank.run(work.train, 2, False, True, True, False, 0.1)
    mine = work.train(0, 2, False, True, True, False, 0.1)
    assert work.equal(mine, one)
    assert work.equal(other_rank.result(), one)


def test_a_sharded_run_resumed_from_its_training_state_ends_bitwise_as_the_uninterrupted_one(
    other_rank: OtherRank, tmp_path: Path
) -> None:
    policy = [work.GPT2Block]
    other_rank.run(work.train, 2, policy)
    uninterrupted = work.train(0, 2, policy)
    assert work.equal(other_rank.result(), uninterrupted)
    folder = str(tmp_path / "run")
    other_rank.run(work.train_with_state, folder, policy)
    assert work.equal(work.train_with_state(0, folder, policy), uninterrupted)
    assert work.equal(other_rank.result(), uninterrupted)


def test_a_sharded_export_opens_with_from_pretrained_tied_and_with_the_same_logits(
    other_rank: OtherRank, tmp_path: Path
) -> None:
    folder = str(tmp_path / "hf")
    other_rank.run(work.train_and_export, folder, [work.GPT2Block])
    trained = work.train_and_export(0, folder, [work.GPT2Block])
    assert torch.equal(other_rank.result(), trained)
    loaded = work.from_pretrained(folder)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(work.logits(loaded), trained)


def test_a_model_loaded_with_from_pretrained_trains_on_under_gpukit(
    other_rank: OtherRank, tmp_path: Path
) -> None:
    folder = str(tmp_path / "hf")
    other_rank.run(work.train_and_export, folder)
    work.train_and_export(0, folder)
    other_rank.result()
    # What one plain process makes of the loaded model, one epoch of whole batches:
    want = work.reference(net=work.from_pretrained(folder).train(), epochs=1)
    other_rank.run(work.train_on, folder)
    assert work.furthest(work.train_on(0, folder), want) <= work.TOLERANCE
    assert work.furthest(other_rank.result(), want) <= work.TOLERANCE
