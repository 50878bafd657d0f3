"""Find the largest batch size that fits in memory: ``gk.find_batch_size``.

The search grows from ``start`` (doubling by default) until the first out-of-memory error, then
bisects between the largest size that ran and the smallest that did not. Under the usual
assumption that a size which fits means every smaller size fits too, the result is the largest
size that fits, found in about ``2 * log2(answer / start)`` tries; shrinking by a fixed factor
from a guess (accelerate's ``find_executable_batch_size``) stops at the first size that happens
to fit instead.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

import torch

from gpukit.errors import InvalidArgumentError, MemoryProbeError

__all__ = ["BatchSizeSearch", "find_batch_size", "is_out_of_memory"]

R = TypeVar("R")

log = logging.getLogger("gpukit.memory")

# RuntimeError messages that mean "too big for memory" from code paths that do not raise
# torch.OutOfMemoryError: older builds, other backends, and cuDNN/cuBLAS failing to get
# workspace for a large batch.
_OOM_MESSAGES = (
    "out of memory",
    "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "CUDNN_STATUS_ALLOC_FAILED",
)
_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    {getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError}
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` means "not enough memory": ``torch.OutOfMemoryError`` or a known message.

    Args:
        exc: the exception to look at.
    """
    if isinstance(exc, _OOM_TYPES):
        return True
    if isinstance(exc, RuntimeError) and exc.args and isinstance(exc.args[0], str):
        return any(message in exc.args[0] for message in _OOM_MESSAGES)
    return False


def _free_between_tries() -> None:
    gc.collect()
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def _check_size(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(
            f"{name}={value!r} is not a batch size: it must be a whole number of at least "
            f"{minimum}.",
            hint=f"Pass {name} as an int >= {minimum}.",
        )
    return value


class _Search:
    """One search: runs the tries and remembers their outcome."""

    def __init__(self, fn: Callable[[int], object]) -> None:
        self.fn = fn
        self.tries: list[tuple[int, bool]] = []

    def fits(self, size: int) -> bool:
        message: str | None = None
        try:
            self.fn(size)
        except BaseException as exc:
            if not is_out_of_memory(exc):
                raise
            # Keep only the first line: the message, not the traceback, whose frames would keep
            # the failed try's tensors alive until the next collection.
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if message is not None:
            # Freed only here, after the except block: while it runs, the exception being
            # handled still holds the failed try's frames, and with them its tensors.
            log.info("batch size %d: out of memory (%s)", size, message[:200])
            self.tries.append((size, False))
            _free_between_tries()
            return False
        # No collection after a try that fits: its tensors went with fn's frame, and the CUDA
        # allocator reuses its cached blocks (and releases them itself before it reports OOM).
        log.info("batch size %d: fits", size)
        self.tries.append((size, True))
        return True


@overload
def find_batch_size(
    fn: Callable[[int], object],
    *,
    start: int = ...,
    maximum: int,
    floor: int = ...,
    growth: float = ...,
) -> int: ...
@overload
def find_batch_size(
    fn: None = ...,
    *,
    start: int = ...,
    maximum: int,
    floor: int = ...,
    growth: float = ...,
) -> Callable[[Callable[..., R]], BatchSizeSearch[R]]: ...
def find_batch_size(
    fn: Callable[[int], object] | None = None,
    *,
    start: int = 1,
    maximum: int | None = None,
    floor: int = 1,
    growth: float = 2.0,
) -> int | Callable[[Callable[..., Any]], BatchSizeSearch[Any]]:
    """The largest batch size in ``[floor, maximum]`` for which ``fn(batch_size)`` runs.

    ``fn`` runs one representative step (forward, backward, optimizer step) at the given size.
    Sizes grow from ``start`` by ``growth`` until the first out-of-memory error, then bisect
    down to the largest size that fits; if ``start`` itself does not fit, the search bisects
    between ``floor`` and ``start``. No size below ``floor`` is tried. After each out-of-memory
    try, garbage is collected and the CUDA cache emptied, so the failed try's tensors do not
    count against the next; each try is logged on the ``gpukit.memory`` logger.

    Out of memory means ``torch.OutOfMemoryError`` or a RuntimeError with a known
    out-of-memory message (see :func:`is_out_of_memory`); any other error from ``fn`` is
    re-raised as it is. When torch.distributed is initialised, every process must call this,
    and all return the smallest size any of them found; ``fn`` itself must then not use
    collectives, since processes may try different sizes.

    ``maximum`` is required: on a machine where nothing runs out of memory (a CPU with swap,
    a GPU far larger than the model) the search would grow forever. When every size up to it
    fits, ``maximum`` itself is returned, and the log says "reached maximum=N without running
    out of memory": the largest size that fits may be larger. Every try runs ``fn`` for real,
    so a step that updates the model (an optimizer step) trains it once per try: probe with
    a copy of the model, or reload its weights afterwards.

    Raises :class:`~gpukit.errors.MemoryProbeError` when not even ``floor`` fits, and
    :class:`~gpukit.errors.InvalidArgumentError` for settings out of range or a missing
    ``maximum``.

    Without ``fn`` it is a decorator, in the form of accelerate's
    ``find_executable_batch_size``: the decorated function takes the batch size as its first
    argument, is called without it, and returns its own result at the largest size that fits
    (see :class:`BatchSizeSearch`).

    >>> def step(n: int) -> None:
    ...     if n > 48:
    ...         raise torch.OutOfMemoryError("CUDA out of memory. (a simulated limit)")
    >>> find_batch_size(step, start=8, maximum=1024)
    48

    Args:
        fn: one representative step at the given batch size; None: used as a decorator.
        start: the first size tried, 1 or more.
        maximum: the largest size tried (required: a CPU with swap never runs out).
        floor: the smallest size tried, 1 or more.
        growth: the factor sizes grow by until the first out-of-memory, above 1.
    """
    if fn is not None and not callable(fn):
        raise InvalidArgumentError(
            f"fn={fn!r} is not callable.", hint="Pass a function that takes the batch size."
        )
    settings = _check_settings(start=start, maximum=maximum, floor=floor, growth=growth)
    if fn is None:
        return lambda func: BatchSizeSearch(func, **settings)
    return _find(_Search(fn), **settings)


def _check_settings(
    *, start: int, maximum: int | None, floor: int, growth: float
) -> dict[str, Any]:
    if maximum is None:
        raise InvalidArgumentError(
            "find_batch_size needs maximum=, the largest batch size worth trying: where "
            "nothing runs out of memory, the search would otherwise grow forever.",
            hint="Pass e.g. maximum=1024 (the dataset's size is a natural bound).",
        )
    floor = _check_size("floor", floor)
    start = _check_size("start", start)
    maximum = _check_size("maximum", maximum)
    if not floor <= start <= maximum:
        raise InvalidArgumentError(
            f"find_batch_size needs floor <= start <= maximum, but got floor={floor}, "
            f"start={start}, maximum={maximum}.",
            hint="Lower start, or raise maximum.",
        )
    if (
        isinstance(growth, bool)
        or not isinstance(growth, (int, float))
        or not 1 < growth < math.inf
    ):
        raise InvalidArgumentError(
            f"growth={growth!r} would not grow the batch size.",
            hint="Pass a factor above 1, such as 2.",
        )
    return {"start": start, "maximum": maximum, "floor": floor, "growth": float(growth)}


def _find(search: _Search, *, start: int, maximum: int, floor: int, growth: float) -> int:
    """Run the search; agree across processes; raise when nothing fits."""
    try:
        found: int | None = _search(
            search, start=start, maximum=maximum, floor=floor, growth=growth
        )
    except MemoryProbeError:
        found = None
    from gpukit._agree import smallest  # torch.distributed, imported when a search ends

    # Every process reaches the agreement, even one that found nothing (it sends 0), so no
    # process waits forever on another that gave up.
    agreed = smallest(found or 0)
    if agreed == 0:
        tried = ", ".join(f"{s} ({'fits' if ok else 'out of memory'})" for s, ok in search.tries)
        raise MemoryProbeError(
            f"No batch size from {floor} to {maximum} fits in memory"
            + ("" if found is None else " on every process")
            + f"; tried {tried or 'nothing here'}.",
            hint="Lower floor, free memory (gk.memory_report() shows what holds it), or use "
            "a smaller model, mixed precision or gradient accumulation.",
        )
    if agreed != found:
        log.info("batch size %s here, %d agreed across processes", found, agreed)
    return agreed


class BatchSizeSearch(Generic[R]):
    """A function searched for its largest batch size: what ``@find_batch_size(...)`` makes.

    Calling it with the arguments that follow the batch size runs the same search as
    ``find_batch_size(fn, ...)``, calling ``fn(batch_size, *args, **kwargs)`` for each try,
    then calls ``fn`` once more at the size found and returns that call's result. Probe tries'
    results are dropped as soon as they return, so what a try keeps alive (a model, its
    activations) never counts against the next, and the bisection stays exact. ``batch_size``
    is the size of the last search (None before the first).

    >>> @find_batch_size(start=8, maximum=1024)
    ... def train(batch_size: int, epochs: int) -> str:
    ...     if batch_size > 48:
    ...         raise torch.OutOfMemoryError("CUDA out of memory. (a simulated limit)")
    ...     return f"{epochs} epochs at batch size {batch_size}"
    >>> train(3)
    '3 epochs at batch size 48'
    >>> train.batch_size
    48
    """

    def __init__(
        self, fn: Callable[..., R], *, start: int, maximum: int, floor: int, growth: float
    ) -> None:
        if not callable(fn):
            raise InvalidArgumentError(
                f"@find_batch_size(...) decorates a function, not {fn!r}.",
                hint="Put it above a function whose first parameter is the batch size.",
            )
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.batch_size: int | None = None
        self._settings: dict[str, Any] = {
            "start": start,
            "maximum": maximum,
            "floor": floor,
            "growth": growth,
        }

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        def probe(size: int) -> None:
            self.fn(size, *args, **kwargs)

        self.batch_size = _find(_Search(probe), **self._settings)
        return self.fn(self.batch_size, *args, **kwargs)


def _search(search: _Search, *, start: int, maximum: int, floor: int, growth: float) -> int:
    # Invariant: `good` fits (or is floor - 1, meaning nothing fits yet), `bad` does not fit
    # (or is maximum + 1, meaning nothing has failed yet).
    good, bad = floor - 1, maximum + 1
    size = start
    while True:
        if search.fits(size):
            good = size
            if size == maximum:
                log.info(
                    "batch size %d: reached maximum=%d without running out of memory; larger "
                    "sizes were not tried",
                    size,
                    maximum,
                )
                return size
            size = min(maximum, max(size + 1, math.ceil(size * growth)))
        else:
            bad = size
            break
    while bad - good > 1:
        mid = (good + bad) // 2
        if search.fits(mid):
            good = mid
        else:
            bad = mid
    if good < floor:
        raise MemoryProbeError(f"batch size {floor} does not fit.")
    return good
