"""The transformers model of ``workloads.py`` where CUDA exists: exact mode with dropout under
bf16 autocast, cuBLAS's fixed workspace, run twice to the same bits.

Skipped without a CUDA device; the CPU tests beside it hold the same model to 1e-12 in float64.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import needs_gpus

pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install -e '.[hf]' runs these"
)

from tests.hf import workloads as work


@needs_gpus(1)
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_exact_mode_trains_the_model_on_a_gpu_to_the_same_bits_twice(precision: str) -> None:
    first, device = work.train_exact_float32(precision)
    assert device == "cuda"
    second, _ = work.train_exact_float32(precision)
    assert work.equal(first, second)
    assert all(torch.isfinite(v).all() for v in first.values())
