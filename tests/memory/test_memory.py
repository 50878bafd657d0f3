"""memory_report, track_peak and free_memory on the CPU (CUDA paths need a GPU)."""

from __future__ import annotations

import gc
import json
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as tdist
from torch import nn

import gpukit as gk
from gpukit.errors import DeviceError, InvalidArgumentError
from gpukit.memory.report import MemoryReport
from tests.helpers import needs_gpus

MiB = 1 << 20


@contextmanager
def _nothing_else_freed() -> Iterator[None]:
    """No collection inside the block: freeing earlier tests' garbage would hide its growth."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _use_fresh_pages(nbytes: int) -> None:
    """Make the process's resident set grow by ``nbytes`` for a moment, then shrink back.

    Pages straight from the kernel, each written once, so no allocator can serve them from
    memory the process already holds; unmapped before returning.
    """
    with mmap.mmap(-1, nbytes) as pages:
        for offset in range(0, nbytes, mmap.PAGESIZE):
            pages[offset] = 1


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(1024, 1024), nn.LayerNorm(1024))
        self.register_buffer("table", torch.zeros(300, 1024))


def test_memory_report_names_the_largest_cpu_tensors_by_parameter_path() -> None:
    model = Tower()
    report = gk.memory_report("cpu", module=model, top=50)
    names = [t.name for t in report.tensors]
    assert "table" in names
    assert "encoder.0.weight" in names
    weight = next(t for t in report.tensors if t.name == "encoder.0.weight")
    assert (weight.shape, weight.dtype, weight.nbytes) == ((1024, 1024), "float32", 4 * MiB)


def test_memory_report_lists_tensors_largest_first_and_at_most_top() -> None:
    keep = [torch.ones(n * 1000) for n in (3, 1, 2)]
    report = gk.memory_report("cpu", top=2)
    sizes = [t.nbytes for t in report.tensors]
    assert len(sizes) == 2
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] >= keep[0].nbytes


def test_memory_report_names_tensors_of_live_modules_without_being_told() -> None:
    model = Tower()
    report = gk.memory_report("cpu", top=100)
    assert "Tower.table" in [t.name for t in report.tensors]
    del model


def test_memory_report_counts_a_storage_once_however_many_views_share_it() -> None:
    base = torch.zeros(2 * MiB // 4)
    views = [base[:10], base[5:], base.view(2, -1)]
    report = gk.memory_report("cpu", top=1000)
    ptr_sizes = [t.nbytes for t in report.tensors if t.nbytes == base.nbytes]
    assert len(ptr_sizes) == 1
    assert views


@pytest.fixture
def sharded_here(tmp_path: Path) -> Iterator[nn.Module]:
    """A model sharded with FSDP2 over a gloo group of this process alone."""
    from gpukit.train.shard import shard

    tdist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 2))
        yield shard(model, device=torch.device("cpu"), weight=lambda: 1.0)
    finally:
        tdist.destroy_process_group()


def test_memory_report_of_a_sharded_model_counts_and_names_its_local_shards(
    sharded_here: nn.Module,
) -> None:
    # A DTensor's own storage is no memory (reading its address raises): its shard, a plain
    # tensor of this process, is what is counted and named.
    for report in (gk.memory_report("cpu", top=50), gk.memory_report("cpu", module=sharded_here)):
        weight = next(t for t in report.tensors if (t.name or "").endswith("0.weight"))
        assert (weight.shape, weight.nbytes) == ((512, 512), 512 * 512 * 4)


def test_memory_report_gives_process_rss_on_cpu() -> None:
    report = gk.memory_report("cpu", top=0)
    rss = psutil.Process().memory_info().rss
    assert report.rss is not None
    assert abs(report.rss - rss) < 64 * MiB
    assert report.peak is not None
    assert report.peak >= report.rss - 64 * MiB
    assert report.reserved is None


def test_memory_report_allocated_grows_with_a_new_cpu_tensor() -> None:
    before = gk.memory_report("cpu", top=0).allocated
    big = torch.ones(8 * MiB // 4)
    after = gk.memory_report("cpu", top=0).allocated
    assert before is not None
    assert after is not None
    assert after - before >= big.nbytes


def test_memory_report_to_json_round_trips_through_json_with_a_schema() -> None:
    report = gk.memory_report("cpu", module=Tower(), top=3)
    data = json.loads(json.dumps(report.to_json()))
    assert data["schema"] == "gpukit.memory_report/1"
    assert data["reserved"] is None
    assert len(data["tensors"]) == 3
    assert data["tensors"][0]["shape"] == list(report.tensors[0].shape)


def test_memory_report_str_is_a_table_with_na_for_missing_readings() -> None:
    report = gk.memory_report("cpu", module=Tower(), top=2)
    text = str(report)
    assert text.splitlines()[0] == "memory on cpu"
    assert "reserved" in text
    assert "n/a" in text
    assert "encoder.0.weight" in text or "table" in text


def test_memory_report_rejects_a_negative_top() -> None:
    with pytest.raises(InvalidArgumentError, match="top=-1"):
        gk.memory_report("cpu", top=-1)


def test_memory_report_rejects_an_unknown_device() -> None:
    with pytest.raises(DeviceError):
        gk.memory_report("gpu")


def test_track_peak_sees_a_tensor_freed_inside_the_block() -> None:
    with _nothing_else_freed(), gk.track_peak("cpu") as mem:
        _use_fresh_pages(64 * MiB)
    assert mem.increase is not None
    assert mem.increase >= 48 * MiB
    assert mem.end is not None
    assert mem.peak is not None
    assert mem.peak - mem.end >= 48 * MiB


def test_track_peak_outer_block_keeps_the_peak_of_an_inner_block() -> None:
    with _nothing_else_freed(), gk.track_peak("cpu") as outer:
        with gk.track_peak("cpu") as inner:
            _use_fresh_pages(64 * MiB)
        assert inner.increase is not None
        assert inner.increase >= 48 * MiB
    assert outer.peak is not None
    assert inner.peak is not None
    assert outer.peak >= inner.peak


def test_track_peak_rejects_the_meta_device() -> None:
    with pytest.raises(InvalidArgumentError, match="meta"), gk.track_peak(torch.device("meta")):
        pass


def test_free_memory_frees_a_module_that_nothing_else_holds() -> None:
    model = Tower()
    size = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    report = gk.free_memory(model)
    assert report.freed == size
    assert report.still_referenced == 0
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.encoder[0].weight.shape == (1024, 1024)


def test_free_memory_reports_storage_that_another_reference_keeps_alive() -> None:
    model = nn.Linear(512, 512)
    kept = model.weight.detach()  # shares the weight's storage
    report = gk.free_memory(model)
    assert report.still_referenced == kept.nbytes
    assert report.freed == model.bias.numel() * 4
    assert "still referenced" in str(report)


def test_free_memory_empties_a_tensor_but_not_its_views() -> None:
    base = torch.ones(1000)
    view = base[:10]
    gk.free_memory(base)
    assert base.numel() == 0
    assert torch.equal(view, torch.ones(10))


def test_free_memory_clears_containers_and_optimizer_state() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    cache = {"activations": torch.ones(100)}
    report = gk.free_memory(opt, cache)
    assert cache == {}
    assert len(opt.state) == 0
    assert report.freed >= 100 * 4


def test_free_memory_rejects_objects_that_hold_no_tensors() -> None:
    with pytest.raises(InvalidArgumentError, match="cannot release a str"):
        gk.free_memory("model")


@needs_gpus(1)
def test_memory_report_on_cuda_reads_the_allocator() -> None:
    x = torch.ones(MiB, device="cuda")
    report = gk.memory_report("cuda:0")
    assert isinstance(report, MemoryReport)
    assert report.allocated is not None
    assert report.allocated >= x.nbytes
    assert report.reserved is not None
    assert report.reserved >= report.allocated
    assert report.total is not None
    assert report.free is not None


@needs_gpus(1)
def test_track_peak_on_cuda_sees_a_freed_tensor() -> None:
    with gk.track_peak("cuda:0") as mem:
        temp = torch.ones(16 * MiB // 4, device="cuda")
        del temp
    assert mem.increase is not None
    assert mem.increase >= 16 * MiB
