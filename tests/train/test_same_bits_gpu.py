"""Exact mode where CUDA exists: cuBLAS's fixed workspace, bf16 kernels, NCCL.

Skipped without a CUDA device (two for the test that launches two processes). The CPU tests
(``test_same_bits.py``) hold the same promise on gloo.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from gpukit.distributed import launch
from tests.helpers import needs_gpus

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import same_bits as work


def _equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(
        torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want, strict=True)
    )


@needs_gpus(1)
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_exact_mode_on_a_gpu_ends_bitwise_alike_run_after_run(precision: str) -> None:
    # Dropout's masks come from the CUDA generator, seeded per micro-batch; cuBLAS runs with
    # its fixed workspace under deterministic algorithms.
    case = work.Case(precision=precision)
    first = work.run(case)
    assert first["weights"][0].device.type == "cuda"
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")
    assert torch.are_deterministic_algorithms_enabled()
    second = work.run(case)
    assert _equal(second["weights"], first["weights"])
    assert _equal(second["optimizer"], first["optimizer"])


@needs_gpus(2)
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("shard", [False, True], ids=["unsharded", "fsdp2"])
def test_two_gpus_on_nccl_end_bitwise_with_one(precision: str, shard: bool) -> None:
    case = work.Case(precision=precision, shard=shard)
    one = work.run(case.but(shard=False))
    for result in launch(work.run, 2, case):
        assert _equal(result["weights"], one["weights"])
        assert _equal(result["optimizer"], one["optimizer"])
