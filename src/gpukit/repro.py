"""Reproducibility: seed every generator and set the determinism switches in one call."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from gpukit.devices import cuda_initialized
from gpukit.errors import InvalidArgumentError, check_bool

__all__ = ["SEED_VAR", "ReproSettings", "seed_everything", "seed_worker"]

log = logging.getLogger("gpukit.repro")

SEED_VAR = "GPUKIT_SEED"  # the seed of seed_everything() when it is given none

# cuBLAS needs a fixed workspace to give deterministic results on CUDA >= 10.2; PyTorch raises
# at run time under use_deterministic_algorithms(True) when this is missing.
_CUBLAS_VAR = "CUBLAS_WORKSPACE_CONFIG"
_CUBLAS_DETERMINISTIC = ":4096:8"
_MAX_SEED = 2**32 - 1  # NumPy's legacy generator accepts no more


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # NumPy is optional
        return None
    return numpy


@dataclass
class ReproSettings:
    """The settings and random states in force before :func:`seed_everything` changed them.

    Use it as a context manager to put them all back when the block ends:

    >>> with seed_everything(0, deterministic=True):
    ...     pass  # deterministic here; everything restored afterwards

    Made by :meth:`capture`, which also records the random states (the ``_``-named fields).

    Args:
        cudnn_deterministic: ``torch.backends.cudnn.deterministic`` as it was.
        cudnn_benchmark: ``torch.backends.cudnn.benchmark`` as it was.
        deterministic_algorithms: whether ``torch.use_deterministic_algorithms`` was on.
        deterministic_warn_only: whether it only warned (``warn_only=True``).
        cublas_workspace_config: ``$CUBLAS_WORKSPACE_CONFIG`` as it was; None: unset.
        seed: the seed :func:`seed_everything` then set; None for a bare :meth:`capture`.
        seed_source: where that seed came from: ``"argument"``, ``"GPUKIT_SEED"`` or
            ``"default"`` (``""`` for a bare :meth:`capture`).
    """

    cudnn_deterministic: bool
    cudnn_benchmark: bool
    deterministic_algorithms: bool
    deterministic_warn_only: bool
    cublas_workspace_config: str | None
    _python_state: Any = field(repr=False)
    _numpy_state: Any = field(repr=False)
    _torch_state: torch.Tensor = field(repr=False)
    _cuda_states: list[torch.Tensor] | None = field(repr=False)
    seed: int | None = None
    """The seed :func:`seed_everything` then set (None for a bare :meth:`capture`)."""
    seed_source: str = ""
    """Where that seed came from: ``"argument"``, ``"GPUKIT_SEED"`` or ``"default"``."""

    @classmethod
    def capture(cls) -> ReproSettings:
        """Record the current switches and random states."""
        np = _numpy()
        return cls(
            cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cublas_workspace_config=os.environ.get(_CUBLAS_VAR),
            _python_state=random.getstate(),
            _numpy_state=np.random.get_state() if np is not None else None,
            _torch_state=torch.random.get_rng_state(),
            # Reading CUDA generator states would start CUDA; only do it if CUDA already runs.
            _cuda_states=torch.cuda.get_rng_state_all() if cuda_initialized() else None,
        )

    def restore(self) -> None:
        """Put every recorded switch and random state back."""
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.use_deterministic_algorithms(
            self.deterministic_algorithms, warn_only=self.deterministic_warn_only
        )
        if self.cublas_workspace_config is None:
            os.environ.pop(_CUBLAS_VAR, None)
        else:
            os.environ[_CUBLAS_VAR] = self.cublas_workspace_config
        random.setstate(self._python_state)
        np = _numpy()
        if np is not None and self._numpy_state is not None:
            np.random.set_state(self._numpy_state)
        torch.random.set_rng_state(self._torch_state)
        if self._cuda_states is not None:
            torch.cuda.set_rng_state_all(self._cuda_states)

    def __enter__(self) -> ReproSettings:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.restore()


def _seed_from_env() -> tuple[int, str]:
    raw = os.environ.get(SEED_VAR)
    if raw is None or not raw.strip():
        return 0, "default"
    try:
        return int(raw.strip(), 10), SEED_VAR
    except ValueError:
        raise InvalidArgumentError(
            f"{SEED_VAR}={raw!r} is not a whole number, so it cannot seed the run.",
            hint=f"Set {SEED_VAR} to an integer from 0 to {_MAX_SEED}, or unset it to use 0.",
        ) from None


def seed_everything(
    seed: int | None = None, *, deterministic: bool = False, benchmark: bool | None = None
) -> ReproSettings:
    """Seed Python, NumPy (if installed) and torch on every device; optionally go deterministic.

    Without ``seed``, the seed is read from the ``GPUKIT_SEED`` environment variable, or is 0
    when that is unset; the returned settings say which (``.seed``, ``.seed_source``), and the
    choice is logged on the ``gpukit.repro`` logger, so a run launched with ``GPUKIT_SEED=7``
    records what it used.

    ``deterministic=True`` turns on ``torch.use_deterministic_algorithms`` (ops without a
    deterministic implementation then raise), sets ``cudnn.deterministic``, turns cuDNN's
    autotuner off, and sets ``CUBLAS_WORKSPACE_CONFIG`` when it is not set already.
    ``benchmark`` sets ``torch.backends.cudnn.benchmark`` explicitly (``None``: off when
    deterministic, else unchanged).

    Returns the previous settings; used as a context manager, they come back when the block ends.

    >>> seed_everything(1234).seed
    1234

    Args:
        seed: the seed, 0 to 2**32 - 1; None: ``$GPUKIT_SEED``, else 0.
        deterministic: whether to turn on deterministic algorithms and cuDNN.
        benchmark: cuDNN's autotuner on or off; None: off when deterministic, else unchanged.
    """
    source = "argument"
    if seed is None:
        seed, source = _seed_from_env()
        where = f"from {SEED_VAR}" if source == SEED_VAR else f"{SEED_VAR} is not set"
        log.info("seed_everything: seed %d (%s)", seed, where)
    for name, switch in (("deterministic", deterministic), ("benchmark", benchmark)):
        if not isinstance(switch, bool) and not (name == "benchmark" and switch is None):
            raise InvalidArgumentError(
                f"{name}={switch!r} is not a bool.", hint=f"Pass {name}=True or {name}=False."
            )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidArgumentError(
            f"seed={seed!r} is not an integer.", hint="Pass a whole number such as 0 or 1234."
        )
    if not 0 <= seed <= _MAX_SEED:
        origin = f" (from {SEED_VAR})" if source == SEED_VAR else ""
        raise InvalidArgumentError(
            f"seed={seed}{origin} is outside 0..{_MAX_SEED}, the range every generator accepts.",
            hint="Pass a seed in that range, for example seed % 2**32.",
        )
    check_bool("deterministic", deterministic)
    check_bool("benchmark", benchmark, allow_none=True)
    if benchmark is not None and deterministic and benchmark:
        raise InvalidArgumentError(
            "deterministic=True with benchmark=True: cuDNN's autotuner picks kernels by timing, "
            "so results could differ between runs.",
            hint="Leave benchmark unset (it is turned off) or pass deterministic=False.",
        )
    previous = ReproSettings.capture()
    previous.seed, previous.seed_source = seed, source
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed)
    torch.manual_seed(seed)  # seeds the CPU and every CUDA generator (lazily for CUDA)
    if deterministic:
        os.environ.setdefault(_CUBLAS_VAR, _CUBLAS_DETERMINISTIC)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    if benchmark is not None:
        torch.backends.cudnn.benchmark = benchmark
    return previous


def seed_worker(worker_id: int) -> None:
    """Give each DataLoader worker its own stream in Python's ``random``, NumPy and torch.

    Pass it as ``DataLoader(..., worker_init_fn=gk.seed_worker)``. Every worker's generators are
    seeded from the seed torch gave that worker (``torch.initial_seed()``: the loader's base
    seed, drawn from the main process's generator each epoch, plus the worker id), so workers
    never repeat each other's random augmentations, a new epoch draws new ones, and a run
    seeded with :func:`seed_everything` draws the same ones again. Called outside a worker it
    raises :class:`~gpukit.errors.InvalidArgumentError`.

    Args:
        worker_id: the worker's id, as the DataLoader passes it.
    """
    from torch.utils.data import get_worker_info

    if get_worker_info() is None:
        raise InvalidArgumentError(
            f"seed_worker({worker_id!r}) was called outside a DataLoader worker process.",
            hint="Pass it to the loader instead: DataLoader(..., num_workers=N, "
            "worker_init_fn=gk.seed_worker).",
        )
    worker_seed = torch.initial_seed()  # base seed + worker id, 64 bits
    # NumPy's legacy seeding takes 32 bits: fold the high half in rather than drop it.
    folded = (worker_seed ^ (worker_seed >> 32)) & _MAX_SEED
    random.seed(worker_seed)
    np = _numpy()
    if np is not None:
        np.random.seed(folded)
    torch.manual_seed(worker_seed)
