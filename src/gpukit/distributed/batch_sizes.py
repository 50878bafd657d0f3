"""How many samples each process loads per micro-batch, and how many micro-batches make a step.

``prepare()`` takes the batch size explicitly: ``per_device_batch_size`` (each process loads B),
``global_batch_size`` (one optimizer step sees G over every process), both (then the step takes
G / (B x processes) micro-batches), or either with ``accumulate=K``. Two of the three decide the
third, and every combination that cannot be split evenly is refused before any work.
"""

from __future__ import annotations

from gpukit.errors import InvalidArgumentError

__all__ = ["micro_batches", "per_device_size"]


def per_device_size(
    world_size: int, per_device_batch_size: int | None, global_batch_size: int | None
) -> int:
    """The batch size each process loads, from exactly one of the two explicit sizes."""
    if (per_device_batch_size is None) == (global_batch_size is None):
        raise InvalidArgumentError(
            "prepare() got a loader and "
            + (
                "both per_device_batch_size and global_batch_size."
                if per_device_batch_size is not None
                else "neither per_device_batch_size nor global_batch_size."
            ),
            hint="Pass exactly one: per_device_batch_size=B (each process loads B, the step sees "
            "B x world size) or global_batch_size=G (the step sees G whatever the world size).",
        )
    for name, value in (
        ("per_device_batch_size", per_device_batch_size),
        ("global_batch_size", global_batch_size),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidArgumentError(
                f"{name}={value!r} is not a batch size.",
                hint="Pass a whole number of samples (an int).",
            )
    if global_batch_size is not None:
        if global_batch_size < 1 or global_batch_size % world_size:
            raise InvalidArgumentError(
                f"global_batch_size={global_batch_size} cannot be split evenly over "
                f"{world_size} processes.",
                hint=f"Use a positive multiple of {world_size}, or per_device_batch_size.",
            )
        return global_batch_size // world_size
    assert per_device_batch_size is not None
    if per_device_batch_size < 1:
        raise InvalidArgumentError(
            f"per_device_batch_size={per_device_batch_size} is not a batch size.",
            hint="Use a positive number of samples per process.",
        )
    return per_device_batch_size


def micro_batches(
    world_size: int,
    per_device_batch_size: int | None,
    global_batch_size: int | None,
    accumulate: int | None,
) -> tuple[int, int]:
    """Each process's micro-batch size and the micro-batches per optimizer step (K).

    Two of the three sizes decide the third: ``global_batch_size = per_device_batch_size x
    world_size x K``. With one batch size alone and no ``accumulate``, K is 1.
    """
    if accumulate is not None and (
        isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1
    ):
        raise InvalidArgumentError(
            f"accumulate={accumulate!r} is not a number of micro-batches per optimizer step.",
            hint="Pass a whole number, 1 or more (1: no accumulation).",
        )
    if per_device_batch_size is None or global_batch_size is None:
        steps = accumulate or 1
        if global_batch_size is None:
            return per_device_size(world_size, per_device_batch_size, None), steps
        per_device_size(world_size, None, global_batch_size)  # its type, sign and split
        if global_batch_size % (world_size * steps):
            raise InvalidArgumentError(
                f"global_batch_size={global_batch_size} cannot be cut into {steps} "
                f"micro-batches on each of {world_size} processes.",
                hint=f"Use a multiple of {world_size * steps}, or another accumulate=.",
            )
        return global_batch_size // (world_size * steps), steps
    size = per_device_size(world_size, per_device_batch_size, None)
    per_step = size * world_size
    per_device_size(world_size, None, global_batch_size)  # the same checks on the global size
    if global_batch_size % per_step or (accumulate and accumulate * per_step != global_batch_size):
        raise InvalidArgumentError(
            f"global_batch_size={global_batch_size} is not per_device_batch_size={size} x "
            f"{world_size} processes x "
            + (f"accumulate={accumulate}." if accumulate else "a whole number of micro-batches."),
            hint="Give two of the three sizes and let prepare() derive the third, or pick "
            f"a global batch that is a multiple of {per_step}.",
        )
    return size, global_batch_size // per_step
