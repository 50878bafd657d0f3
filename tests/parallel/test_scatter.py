from __future__ import annotations

from collections import OrderedDict, defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpukit._tree import leaves_with_paths
from gpukit.errors import InvalidArgumentError, ScatterError
from gpukit.parallel import chunk_sizes, scatter

from ._structures import Frozen, Pair, batches, same_structure

CPU4 = ["cpu"] * 4


def test_scatter_splits_an_uneven_batch_as_evenly_as_possible() -> None:
    parts = scatter(torch.arange(9), CPU4)
    assert [len(p) for p in parts] == [3, 2, 2, 2]
    assert torch.equal(torch.cat(parts), torch.arange(9))


def test_scatter_never_gives_a_replica_an_empty_chunk() -> None:
    parts = scatter(torch.arange(3), CPU4)
    assert [len(p) for p in parts] == [1, 1, 1]


def test_scatter_min_chunk_runs_fewer_replicas_rather_than_tiny_chunks() -> None:
    parts = scatter(torch.arange(9), CPU4, min_chunk=4)
    assert [len(p) for p in parts] == [5, 4]


def test_scatter_splits_along_the_requested_dim() -> None:
    parts = scatter(torch.zeros(2, 8), ["cpu"] * 2, dim=1)
    assert [tuple(p.shape) for p in parts] == [(2, 4), (2, 4)]


def test_scatter_passes_non_tensors_to_every_replica_unchanged() -> None:
    config = {"mode": "train"}
    parts = scatter((torch.zeros(4), config, 0.5), CPU4)
    assert all(p[1] is config and p[2] == 0.5 for p in parts)


def test_scatter_passes_modules_through_without_moving_them() -> None:
    head = torch.nn.Linear(1, 1)
    parts = scatter((torch.zeros(2), head), ["cpu"] * 2)
    assert all(p[1] is head for p in parts)


def test_scatter_keeps_every_container_type() -> None:
    counts: defaultdict[str, list[int]] = defaultdict(list)
    batch = (
        OrderedDict(x=torch.zeros(4)),
        counts,
        Pair(torch.zeros(4), 1),
        Frozen(torch.zeros(4), "t"),
    )
    first = scatter(batch, ["cpu"] * 2)[0]
    assert [type(part) for part in first] == [OrderedDict, defaultdict, Pair, Frozen]
    assert first[3].value.shape == (2,)


def test_scatter_names_paths_and_sizes_when_tensors_disagree() -> None:
    batch = ((torch.zeros(8, 3),), {"mask": torch.zeros(6)})
    with pytest.raises(ScatterError) as info:
        scatter(batch, CPU4)
    assert "8 (inputs[0][0])" in str(info.value)
    assert "6 (inputs[1]['mask'])" in str(info.value)


def test_scatter_rejects_a_tensor_without_the_split_dim() -> None:
    with pytest.raises(ScatterError, match=r"inputs\['t'\] has shape \(\)"):
        scatter({"x": torch.zeros(4), "t": torch.tensor(1.0)}, CPU4)


def test_scatter_without_tensors_gives_one_copy_for_the_first_device() -> None:
    batch = {"n": 3}
    assert scatter(batch, CPU4) == [batch]


def test_scatter_rejects_an_empty_device_list() -> None:
    with pytest.raises(InvalidArgumentError, match="no devices"):
        scatter(torch.zeros(2), [])


@given(total=st.integers(0, 200), replicas=st.integers(1, 9), min_chunk=st.integers(1, 8))
def test_chunk_sizes_are_even_complete_and_within_the_device_count(
    total: int, replicas: int, min_chunk: int
) -> None:
    sizes = chunk_sizes(total, replicas, min_chunk=min_chunk)
    assert sum(sizes) == total
    assert 1 <= len(sizes) <= replicas
    assert max(sizes) - min(sizes) <= 1
    if total >= min_chunk:
        assert min(sizes) >= min_chunk
    if total >= replicas * min_chunk:
        assert len(sizes) == replicas


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 11), devices=st.integers(1, 5), data=st.data())
def test_scatter_chunks_concatenate_back_to_every_tensor(
    size: int, devices: int, data: st.DataObject
) -> None:
    batch = data.draw(batches(size))
    parts = scatter(batch, ["cpu"] * devices)
    originals = list(leaves_with_paths(batch))
    chunked = [list(leaves_with_paths(part)) for part in parts]
    for position, (path, tensor) in enumerate(originals):
        assert all(c[position][0] == path for c in chunked)
        assert torch.equal(torch.cat([c[position][1] for c in chunked]), tensor)


@settings(max_examples=25, deadline=None)
@given(size=st.integers(1, 11), data=st.data())
def test_scatter_to_one_device_gives_back_the_same_batch(size: int, data: st.DataObject) -> None:
    batch = data.draw(batches(size))
    (only,) = scatter(batch, ["cpu"])
    assert same_structure(only, batch)


# -- exact answers at the edges, and what the user reads -----------------------------------------


@pytest.mark.parametrize(
    ("total", "replicas", "min_chunk", "sizes"),
    [
        (0, 4, 1, [0]),
        (1, 1, 1, [1]),
        (8, 4, 1, [2, 2, 2, 2]),
        (10, 4, 1, [3, 3, 2, 2]),
        (8, 4, 2, [2, 2, 2, 2]),
        (8, 4, 3, [4, 4]),
        (3, 4, 5, [3]),
    ],
)
def test_chunk_sizes_split_a_batch_exactly_so(
    total: int, replicas: int, min_chunk: int, sizes: list[int]
) -> None:
    assert chunk_sizes(total, replicas, min_chunk=min_chunk) == sizes


def test_chunk_sizes_refuse_no_replicas_and_a_minimum_below_one() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        chunk_sizes(4, 0)
    assert (caught.value.message, caught.value.hint) == (
        "chunk_sizes was asked for 0 replicas.",
        "Pass at least one device.",
    )
    assert chunk_sizes(4, 1) == [4]
    assert chunk_sizes(3, 4) == [1, 1, 1]  # by default a chunk may hold one sample
    with pytest.raises(InvalidArgumentError) as caught:
        chunk_sizes(4, 2, min_chunk=0)
    assert (caught.value.message, caught.value.hint) == (
        "min_chunk=0 is below 1.",
        "Use min_chunk=1 (the default) or more.",
    )


def test_scatter_moves_each_chunk_to_its_device() -> None:
    parts = scatter({"x": torch.zeros(5, 2), "n": 1}, ["meta", "cpu"])
    assert [p["x"].device.type for p in parts] == ["meta", "cpu"]
    assert [tuple(p["x"].shape) for p in parts] == [(3, 2), (2, 2)]
    (only,) = scatter({"x": torch.zeros(5, 2)}, ["meta"])
    assert only["x"].device.type == "meta"
    assert tuple(only["x"].shape) == (5, 2)


def test_scatter_splits_along_a_dim_counted_from_the_end() -> None:
    parts = scatter(torch.arange(6).reshape(1, 6), ["cpu"] * 2, dim=-1)
    assert [p.tolist() for p in parts] == [[[0, 1, 2]], [[3, 4, 5]]]
    parts = scatter(torch.arange(6).reshape(3, 2), ["cpu"] * 2, dim=-2)
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5]]]


@pytest.mark.parametrize("dim", [1, -2])
def test_scatter_names_the_tensor_that_lacks_the_split_dim(dim: int) -> None:
    with pytest.raises(ScatterError) as caught:
        scatter({"x": torch.zeros(4)}, CPU4, dim=dim)
    assert caught.value.message == (
        f"scatter was asked to split along dim {dim}, but inputs['x'] has shape (4,) and so no "
        f"dim {dim}."
    )
    assert caught.value.hint == (
        "Give every tensor in the batch that dimension, or pass values that are the same for "
        "every replica as Python numbers."
    )


def test_scatter_names_at_most_three_paths_per_size_when_tensors_disagree() -> None:
    batch = [torch.zeros(4)] * 5 + [torch.zeros(3)]
    with pytest.raises(ScatterError) as caught:
        scatter(batch, CPU4)
    assert caught.value.message == (
        "scatter was asked to split a batch along dim 0, but its tensors disagree in size "
        "there: 4 (inputs[0], inputs[1], inputs[2] and 2 more); 3 (inputs[5])."
    )
    assert caught.value.hint == (
        "Every tensor in a batch must hold the same number of samples along the split dim; "
        "pass per-batch constants as Python values instead."
    )
    batch = [torch.zeros(4)] * 3 + [torch.zeros(3)]
    with pytest.raises(ScatterError, match=r"4 \(inputs\[0\], inputs\[1\], inputs\[2\]\); 3"):
        scatter(batch, CPU4)
    batch = [torch.zeros(4)] * 4 + [torch.zeros(3)]
    with pytest.raises(ScatterError, match=r"inputs\[2\] and 1 more\); 3 \(inputs\[4\]\)"):
        scatter(batch, CPU4)


def test_scatter_to_no_device_says_to_pass_one() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        scatter(torch.zeros(2), [])
    assert (caught.value.message, caught.value.hint) == (
        "scatter was given no devices.",
        'Pass at least one, for example ["cpu"].',
    )


def test_scatter_gives_each_replica_its_own_samples_of_a_tensor_passed_twice() -> None:
    x = torch.arange(4)
    parts = scatter((x, x), ["cpu"] * 2)
    assert [[t.tolist() for t in p] for p in parts] == [[[0, 1], [0, 1]], [[2, 3], [2, 3]]]


def test_a_negative_number_of_samples_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="split -5 samples"):
        chunk_sizes(-5, 2)
    assert chunk_sizes(0, 4) == [0]  # an empty batch: one empty chunk, as scatter hands it on
