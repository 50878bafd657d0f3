"""find_batch_size: the largest fitting size, the floor, errors, and agreement across processes."""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

import gpukit as gk
import gpukit.memory.batch_size
from gpukit.errors import InvalidArgumentError, MemoryProbeError
from gpukit.memory.batch_size import is_out_of_memory


class SimulatedGpu:
    """A step that runs out of memory above ``limit`` and records every size it was asked."""

    def __init__(self, limit: int, *, error: type[BaseException] = torch.OutOfMemoryError) -> None:
        self.limit = limit
        self.error = error
        self.tried: list[int] = []

    def __call__(self, batch_size: int) -> None:
        self.tried.append(batch_size)
        if batch_size > self.limit:
            raise self.error(f"CUDA out of memory. Tried to allocate {batch_size} (simulated).")


@pytest.fixture(autouse=True)
def frees(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the frees between tries instead of running a full garbage collection each time."""
    calls: list[int] = []
    monkeypatch.setattr(gpukit.memory.batch_size, "_free_between_tries", lambda: calls.append(1))
    return calls


@settings(max_examples=60, deadline=None)
@given(
    limit=st.integers(1, 5000),
    start=st.integers(1, 300),
    extra=st.integers(0, 5000),
)
def test_find_batch_size_returns_exactly_the_largest_size_that_fits(
    limit: int, start: int, extra: int
) -> None:
    maximum = start + extra
    step = SimulatedGpu(limit)
    assert gk.find_batch_size(step, start=start, maximum=maximum) == min(limit, maximum)


@settings(max_examples=40, deadline=None)
@given(limit=st.integers(1, 4000), start=st.integers(1, 64), floor=st.integers(1, 64))
def test_find_batch_size_never_tries_below_the_floor(limit: int, start: int, floor: int) -> None:
    step = SimulatedGpu(limit)
    try:
        gk.find_batch_size(step, start=max(start, floor), maximum=4096, floor=floor)
    except MemoryProbeError:
        assert limit < floor
    assert min(step.tried) >= floor


def test_find_batch_size_raises_memory_probe_error_when_the_floor_does_not_fit() -> None:
    step = SimulatedGpu(limit=7)
    with pytest.raises(MemoryProbeError, match="No batch size from 8 to 64"):
        gk.find_batch_size(step, start=16, maximum=64, floor=8)
    assert step.tried[-1] == 8


def test_find_batch_size_frees_memory_after_every_out_of_memory_try(frees: list[int]) -> None:
    step = SimulatedGpu(limit=10)
    gk.find_batch_size(step, start=1, maximum=64)
    assert len(frees) == sum(1 for size in step.tried if size > step.limit)


def test_find_batch_size_keeps_no_failed_try_tensors_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the real freeing, not the counter
    alive: list[weakref.ref[torch.Tensor]] = []

    def step(batch_size: int) -> None:
        activations = torch.empty(batch_size)
        alive.append(weakref.ref(activations))
        if batch_size > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. (simulated)")

    assert gk.find_batch_size(step, start=2, maximum=4) == 2
    assert all(ref() is None for ref in alive)


def test_find_batch_size_frees_a_failed_try_before_the_next_try_even_in_a_reference_cycle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.undo()  # the real freeing, not the counter
    failed: list[weakref.ref[torch.Tensor]] = []
    alive_at_start: list[bool] = []

    def step(batch_size: int) -> None:
        alive_at_start.append(any(ref() is not None for ref in failed))
        holder: dict[str, object] = {"activations": torch.empty(batch_size)}
        holder["self"] = holder  # a cycle, as closures, hooks and kept exceptions make
        if batch_size > 2:
            failed.append(weakref.ref(holder["activations"]))  # type: ignore[arg-type]
            raise torch.OutOfMemoryError("CUDA out of memory. (simulated)")

    gk.find_batch_size(step, start=2, maximum=16)
    assert len(failed) >= 2
    assert not any(alive_at_start)


def test_find_batch_size_uses_few_tries_for_a_large_range() -> None:
    step = SimulatedGpu(limit=3000)
    assert gk.find_batch_size(step, start=1, maximum=1 << 20) == 3000
    # 13 doublings to pass 3000, then a bisection of the gap (2048, 4096): about 24 tries.
    assert len(step.tried) <= 2 * 12 + 2


def test_find_batch_size_reraises_other_errors_untouched() -> None:
    boom = ValueError("shape mismatch in my model")

    def step(batch_size: int) -> None:
        if batch_size > 4:
            raise boom

    with pytest.raises(ValueError, match="shape mismatch") as info:
        gk.find_batch_size(step, start=1, maximum=64)
    assert info.value is boom


def test_find_batch_size_treats_known_out_of_memory_runtime_errors_as_out_of_memory() -> None:
    step = SimulatedGpu(limit=20, error=RuntimeError)
    assert gk.find_batch_size(step, start=1, maximum=100) == 20


def test_a_runtime_error_without_an_out_of_memory_message_is_not_out_of_memory() -> None:
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))


def test_a_cudnn_not_supported_error_for_a_too_large_batch_counts_as_out_of_memory() -> None:
    # cuDNN's answer for a batch past what its kernels take: smaller batches work.
    cudnn = RuntimeError(
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
        "non-contiguous input."
    )

    def step(batch_size: int) -> None:
        if batch_size > 24:
            raise cudnn

    assert gk.find_batch_size(step, start=8, maximum=256) == 24


@pytest.mark.parametrize("decorator", [False, True], ids=["function", "decorator"])
def test_find_batch_size_without_maximum_is_a_typed_error_saying_why_it_is_needed(
    decorator: bool,
) -> None:
    step = SimulatedGpu(limit=100)
    call = (lambda: gk.find_batch_size(start=1)) if decorator else lambda: gk.find_batch_size(step)
    with pytest.raises(InvalidArgumentError, match="needs maximum=") as info:
        call()
    assert "grow forever" in info.value.message
    assert "maximum=1024" in (info.value.hint or "")
    assert step.tried == []


def test_find_batch_size_logs_each_try(caplog: pytest.LogCaptureFixture) -> None:
    step = SimulatedGpu(limit=5)
    with caplog.at_level(logging.INFO, logger="gpukit.memory"):
        gk.find_batch_size(step, start=1, maximum=16)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == len(step.tried)
    assert any("batch size 8: out of memory" in m for m in logged)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"start": -1, "maximum": 8}, "start=-1"),
        ({"start": 0, "maximum": 8}, "start=0"),
        ({"start": 16, "maximum": 8}, "floor <= start <= maximum"),
        ({"start": 2, "maximum": 8, "floor": 4}, "floor <= start <= maximum"),
        ({"start": 1, "maximum": 8, "growth": 1.0}, "growth"),
        ({"start": 1, "maximum": 8, "growth": float("inf")}, "growth=inf"),
        ({"start": 1.5, "maximum": 8}, "start=1.5"),
        ({"start": True, "maximum": 8}, "start=True"),
    ],
)
def test_find_batch_size_rejects_nonsense_arguments(kwargs: dict, fragment: str) -> None:
    step = SimulatedGpu(limit=100)
    with pytest.raises(InvalidArgumentError, match=fragment.replace("(", r"\(")):
        gk.find_batch_size(step, **kwargs)
    assert step.tried == []


def test_find_batch_size_rejects_a_function_that_is_not_callable() -> None:
    with pytest.raises(InvalidArgumentError, match="not callable"):
        gk.find_batch_size(42, start=1, maximum=8)  # type: ignore[arg-type]


def _worker(rank: int, store: str, limits: list[int], results: dict) -> None:
    # A file store, not a TCP port: a port chosen here could be taken by another process
    # before the group binds it.
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=len(limits)
    )
    try:
        results[rank] = gk.find_batch_size(SimulatedGpu(limits[rank]), start=1, maximum=1024)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_find_batch_size_makes_every_process_agree_on_the_smallest_size(tmp_path: Path) -> None:
    limits = [300, 123]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(str(tmp_path / "store"), limits, results), nprocs=2, join=True)
        assert dict(results) == {0: 123, 1: 123}


# -- the decorator form --------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(limit=st.integers(1, 3000), start=st.integers(1, 64), extra=st.integers(0, 3000))
def test_decorated_function_returns_its_own_result_at_exactly_the_largest_size(
    limit: int, start: int, extra: int
) -> None:
    gpu = SimulatedGpu(limit)

    @gk.find_batch_size(start=start, maximum=start + extra)
    def train(batch_size: int, lr: float, *, tag: str) -> tuple[int, float, str]:
        gpu(batch_size)
        return batch_size, lr, tag

    expected = min(limit, start + extra)
    assert train(0.1, tag="run") == (expected, 0.1, "run")
    assert train.batch_size == expected
    assert gpu.tried[-1] == expected  # the result comes from a run at the size found


def test_decorated_function_tries_the_same_sizes_as_the_plain_search() -> None:
    plain, decorated = SimulatedGpu(48), SimulatedGpu(48)
    gk.find_batch_size(plain, start=8, maximum=1024)

    @gk.find_batch_size(start=8, maximum=1024)
    def step(batch_size: int) -> None:
        decorated(batch_size)

    step()
    assert decorated.tried == [*plain.tried, 48]
    assert plain.tried == [8, 16, 32, 64, 48, 56, 52, 50, 49]


def test_probe_results_are_dropped_before_the_next_try() -> None:
    alive: list[weakref.ref[torch.Tensor]] = []

    @gk.find_batch_size(start=4, maximum=64)
    def make(batch_size: int) -> torch.Tensor:
        held = sum(ref() is not None for ref in alive)
        if batch_size > 16 or held:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        out = torch.zeros(batch_size)
        alive.append(weakref.ref(out))
        return out

    assert make().shape == (16,)


def test_decorator_refuses_bad_settings_at_once_and_a_non_function() -> None:
    with pytest.raises(InvalidArgumentError, match="start"):
        gk.find_batch_size(start=0, maximum=8)
    with pytest.raises(InvalidArgumentError, match="decorates a function"):
        gk.find_batch_size(maximum=8)(5)  # type: ignore[arg-type]


def test_decorated_function_that_never_fits_raises_the_usual_error() -> None:
    @gk.find_batch_size(start=4, maximum=64)
    def step(batch_size: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(MemoryProbeError, match="No batch size from 1 to 64"):
        step()
    assert step.batch_size is None


# -- the exact sizes tried, and what the user reads ---------------------------------------------


def test_the_search_doubles_from_start_then_bisects_to_the_largest_size_that_fits() -> None:
    step = SimulatedGpu(limit=48)
    assert gk.find_batch_size(step, start=8, maximum=1024) == 48
    assert step.tried == [8, 16, 32, 64, 48, 56, 52, 50, 49]


def test_a_small_growth_still_adds_one_sample_per_try_and_stops_at_the_maximum() -> None:
    step = SimulatedGpu(limit=100)
    assert gk.find_batch_size(step, start=1, maximum=5, growth=1.1) == 5
    assert step.tried == [1, 2, 3, 4, 5]
    step = SimulatedGpu(limit=100)
    assert gk.find_batch_size(step, start=3, maximum=20, growth=1.5) == 20
    assert step.tried == [3, 5, 8, 12, 18, 20]


def test_when_start_does_not_fit_the_search_bisects_down_from_it() -> None:
    step = SimulatedGpu(limit=10)
    assert gk.find_batch_size(step, start=64, maximum=64) == 10
    assert step.tried == [64, 32, 16, 8, 12, 10, 11]
    step = SimulatedGpu(limit=4)
    assert gk.find_batch_size(step, start=8, maximum=8, floor=4) == 4
    assert step.tried == [8, 5, 4]  # bisected between the floor and start: never below 4


def test_when_nothing_fits_the_error_lists_every_size_tried() -> None:
    step = SimulatedGpu(limit=3)
    with pytest.raises(MemoryProbeError) as caught:
        gk.find_batch_size(step, start=6, maximum=64, floor=4)
    assert caught.value.message == (
        "No batch size from 4 to 64 fits in memory; tried 6 (out of memory), 4 (out of memory)."
    )
    assert caught.value.hint == (
        "Lower floor, free memory (gk.memory_report() shows what holds it), or use a smaller "
        "model, mixed precision or gradient accumulation."
    )


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (torch.OutOfMemoryError("anything"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError(), False),
        (RuntimeError(42), False),
        (ValueError("CUDA out of memory."), False),
    ],
    ids=repr,
)
def test_only_an_out_of_memory_error_or_message_counts_as_out_of_memory(
    exc: BaseException, expected: bool
) -> None:
    assert is_out_of_memory(exc) is expected


@pytest.mark.parametrize(
    ("kwargs", "message", "hint"),
    [
        (
            {"start": 0, "maximum": 8},
            "start=0 is not a batch size: it must be a whole number of at least 1.",
            "Pass start as an int >= 1.",
        ),
        (
            {"maximum": 2.0},
            "maximum=2.0 is not a batch size: it must be a whole number of at least 1.",
            "Pass maximum as an int >= 1.",
        ),
        (
            {"floor": 0, "maximum": 8},
            "floor=0 is not a batch size: it must be a whole number of at least 1.",
            "Pass floor as an int >= 1.",
        ),
        (
            {"floor": 4, "start": 2, "maximum": 8},
            "find_batch_size needs floor <= start <= maximum, but got floor=4, start=2, maximum=8.",
            "Lower start, or raise maximum.",
        ),
        (
            {"maximum": 8, "growth": 1},
            "growth=1 would not grow the batch size.",
            "Pass a factor above 1, such as 2.",
        ),
        (
            {"maximum": 8, "growth": True},
            "growth=True would not grow the batch size.",
            "Pass a factor above 1, such as 2.",
        ),
        (
            {"maximum": 8, "growth": "2"},
            "growth='2' would not grow the batch size.",
            "Pass a factor above 1, such as 2.",
        ),
    ],
    ids=repr,
)
def test_settings_that_make_no_search_are_refused_saying_what_to_pass(
    kwargs: dict[str, object], message: str, hint: str
) -> None:
    step = SimulatedGpu(limit=100)
    with pytest.raises(InvalidArgumentError) as caught:
        gk.find_batch_size(step, **kwargs)  # type: ignore[arg-type]
    assert (caught.value.message, caught.value.hint) == (message, hint)
    assert step.tried == []


def test_the_edges_of_the_settings_are_accepted() -> None:
    assert gk.find_batch_size(SimulatedGpu(limit=100), start=8, maximum=8, floor=8) == 8
    assert gk.find_batch_size(SimulatedGpu(limit=100), maximum=9, growth=1.01) == 9


def test_the_decorator_keeps_the_functions_name_and_passes_its_arguments() -> None:
    sizes: list[int] = []

    @gk.find_batch_size(start=2, maximum=16)
    def train(batch_size: int, epochs: int, *, lr: float) -> tuple[int, int, float]:
        """Train."""
        sizes.append(batch_size)
        if batch_size > 5:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size, epochs, lr

    assert (train.__name__, train.__doc__, train.batch_size) == ("train", "Train.", None)
    assert train(3, lr=0.1) == (5, 3, 0.1)
    assert train.batch_size == 5
    assert sizes == [2, 4, 8, 6, 5, 5]
    with pytest.raises(InvalidArgumentError) as caught:
        gk.find_batch_size(maximum=8)(3)  # type: ignore[arg-type]
    assert (caught.value.message, caught.value.hint) == (
        "@find_batch_size(...) decorates a function, not 3.",
        "Put it above a function whose first parameter is the batch size.",
    )


def test_the_search_starts_at_1_by_default_and_says_what_fn_must_be() -> None:
    step = SimulatedGpu(limit=100)
    assert gk.find_batch_size(step, maximum=4) == 4
    assert step.tried == [1, 2, 4]
    with pytest.raises(InvalidArgumentError) as caught:
        gk.find_batch_size(42, maximum=8)  # type: ignore[arg-type]
    assert caught.value.hint == "Pass a function that takes the batch size."
