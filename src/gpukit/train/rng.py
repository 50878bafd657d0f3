"""A process's random streams as data: Python's ``random``, NumPy's, torch's CPU and CUDA ones.

:func:`capture` returns them as plain values and tensors only, so that a save of them loads with
``torch.load(weights_only=True)``; :func:`restore` puts them back. Each rank of a job has its own
streams, and the training state saves each rank's in that rank's own file.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from gpukit.errors import CheckpointError
from gpukit.untrusted import InvalidInput, as_dict, as_int, as_list, as_str

__all__ = ["capture", "restore"]

_MT_WORDS = 624  # the words of MT19937's state; its position runs from 0 to 624


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional; without it there is no stream to keep
        return None
    return numpy


def capture() -> dict[str, Any]:
    """This process's random streams now: Python, NumPy (when installed), torch CPU and CUDA.

    CUDA's streams are read only when CUDA is already initialized: reading them would otherwise
    start CUDA in a process that never used it.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    started = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if torch.cuda.is_available() and started:
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _byte_tensor(value: object, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise InvalidInput(f"{what} is not a generator state (a 1-D uint8 tensor)")
    return value


def restore(state: object, *, where: str) -> None:
    """Put back the streams :func:`capture` returned (read back from a save: checked first).

    Nothing is changed unless every part is well-formed. ``where`` names the file in errors.

    Raises:
        CheckpointError: a part is malformed, or the save holds CUDA streams for more devices
            than this process sees.
    """
    try:
        found = as_dict(state, what="the random streams")
        python = as_dict(found.get("python"), what="Python's stream")
        internal = tuple(
            as_int(v, high=(1 << 32) - 1, what="Python's stream")
            for v in as_list(python.get("internal"), limit=1000, what="Python's stream")
        )
        gauss = python.get("gauss")
        if gauss is not None and type(gauss) is not float:
            raise InvalidInput("Python's stream has a malformed cached gaussian")
        python_state = (
            as_int(python.get("version"), high=10, what="Python's version"),
            internal,
            gauss,
        )
        cpu = _byte_tensor(found.get("torch"), "torch's CPU stream")
        cuda = [
            _byte_tensor(t, "a CUDA stream") for t in as_list(found.get("cuda", []), what="CUDA")
        ]
        numpy_state = _numpy_state(found.get("numpy"))
    except InvalidInput as exc:
        raise CheckpointError(
            f"{where} holds random streams that gpukit cannot restore: {exc}.",
            hint="The file was changed or damaged after it was saved; resume from another save.",
        ) from None
    if cuda and len(cuda) > (torch.cuda.device_count() if torch.cuda.is_available() else 0):
        raise CheckpointError(
            f"{where} holds the streams of {len(cuda)} CUDA devices; this process sees "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}.",
            hint="Resume with as many visible devices per process as the run had.",
        )
    # Python and torch check their own states only when given them: a part one of them refuses
    # puts back the streams already set, so that a refused restore changes nothing.
    before = random.getstate(), torch.get_rng_state()
    try:
        random.setstate(python_state)
        torch.set_rng_state(cpu)
        if numpy_state is not None and (np := _numpy()) is not None:
            np.random.set_state(numpy_state)
    except (ValueError, TypeError, RuntimeError) as exc:
        random.setstate(before[0])
        torch.set_rng_state(before[1])
        raise CheckpointError(
            f"{where} holds random streams that gpukit cannot restore: {exc}.",
            hint="The file was changed or damaged after it was saved; resume from another save.",
        ) from None
    for index, value in enumerate(cuda):
        torch.cuda.set_rng_state(value, index)


def _numpy_state(value: object) -> tuple[Any, ...] | None:
    if value is None:
        return None
    np = _numpy()
    if np is None:
        return None  # saved where NumPy was installed; nothing here draws from it
    found = as_dict(value, what="NumPy's stream")
    if as_str(found.get("kind"), limit=32, what="NumPy's generator") != "MT19937":
        raise InvalidInput("NumPy's stream is not of the MT19937 generator")
    keys = found.get("keys")
    if (
        not isinstance(keys, torch.Tensor)
        or keys.dtype != torch.int64
        or keys.shape != (_MT_WORDS,)
        or bool(((keys < 0) | (keys > 0xFFFFFFFF)).any())
    ):
        raise InvalidInput(f"NumPy's stream has malformed keys (not {_MT_WORDS} 32-bit words)")
    cached = found.get("cached_gaussian")
    if type(cached) is not float:
        raise InvalidInput("NumPy's stream has a malformed cached gaussian")
    return (
        "MT19937",
        keys.numpy().astype(np.uint32),
        # NumPy does not check the position: past 624 its draws read outside the generator.
        as_int(found.get("pos"), high=_MT_WORDS, what="NumPy's position"),
        as_int(found.get("has_gauss"), high=1, what="NumPy's gaussian flag"),
        cached,
    )
