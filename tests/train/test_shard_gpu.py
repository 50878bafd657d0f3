"""Sharding where CUDA exists: NCCL, CUDA memory, and a CPU run that must stay on the CPU.

Skipped without a CUDA device (two for the tests that launch two processes).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

import gpukit as gk
from gpukit import distributed as dist
from gpukit.train.shard import shard
from tests.train import shard_workloads as work

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")]
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices")


@pytest.fixture
def group_of_one(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[None]:
    """A one-process group of the backend the test names (gloo or nccl)."""
    tdist.init_process_group(
        request.param, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("group_of_one", ["gloo"], indirect=True)
@pytest.mark.usefixtures("group_of_one")
def test_a_cpu_run_on_a_machine_with_a_gpu_keeps_the_sharded_model_on_the_cpu() -> None:
    # Without an explicit CPU mesh, fully_shard would pick CUDA here (pytorch#132471).
    net = shard(work.model(), device=torch.device("cpu"), weight=lambda: 1.0)
    assert {p.to_local().device.type for p in net.parameters()} == {"cpu"}
    assert net(torch.zeros(2, 4, dtype=torch.float64)).device.type == "cpu"


def _train_on(device: torch.device, sharded: bool) -> list[float]:
    net = work.model()
    net = shard(net, device=device, weight=lambda: 1.0) if sharded else net.to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    x, y = (t.to(device) for t in work.data()[:16])
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [v for vs in work.full_weights(net).values() for v in vs]


@pytest.mark.parametrize("group_of_one", ["nccl"], indirect=True)
@pytest.mark.usefixtures("group_of_one")
def test_a_model_sharded_on_nccl_trains_on_the_gpu_as_the_plain_model_does() -> None:
    cuda = torch.device("cuda", 0)
    sharded = _train_on(cuda, sharded=True)
    plain = _train_on(cuda, sharded=False)
    assert max(abs(a - b) for a, b in zip(sharded, plain, strict=True)) <= 1e-12


@pytest.mark.parametrize("group_of_one", ["nccl"], indirect=True)
@pytest.mark.usefixtures("group_of_one")
@pytest.mark.parametrize("name", ["ckpt", "model.PT"], ids=["dcp folder", "one file"])
def test_a_model_sharded_on_nccl_saves_with_gk_save(tmp_path: Path, name: str) -> None:
    # gk.save's ranks agree through the NCCL default group, which takes no CPU tensor.
    cuda = torch.device("cuda", 0)
    net = work.bumped(shard(work.model(), device=cuda, weight=lambda: 1.0))
    path = gk.save(net, tmp_path / name)
    assert path.is_dir() == (name == "ckpt")
    plain = work.model()
    assert gk.load(plain, path).ok
    assert work.full_weights(plain) == work.full_weights(work.bumped(work.model()))


@needs_two_gpus
def test_two_gpu_processes_each_hold_half_the_parameters_in_cuda_memory() -> None:
    ranks = dist.launch(work.cuda_bytes_after_prepare, 2, None)
    full = 4 * (1024 * 1024 + 1024) * 4
    for rank, found in enumerate(ranks):
        assert found["device"] == f"cuda:{rank}"
        assert full / 2 <= found["allocated"] < 0.75 * full


@pytest.mark.parametrize("group_of_one", ["nccl"], indirect=True)
@pytest.mark.usefixtures("group_of_one")
def test_a_bf16_sharded_model_computes_in_bf16_and_keeps_float32_weights_and_gradients() -> None:
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no native bf16")
    cuda = torch.device("cuda", 0)
    net = shard(work.Stack().float(), device=cuda, weight=lambda: 1.0, param_dtype=torch.bfloat16)
    out = net(torch.randn(8, 4, device=cuda))
    assert out.dtype == torch.bfloat16
    out.float().pow(2).mean().backward()
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in net.parameters() if p.grad is not None} == {torch.float32}
