"""Reproducibility: seed every generator and set the determinism switches in one call."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from gpukit.devices import cuda_initialized
from gpukit.errors import InvalidArgumentError, check_bool

__all__ = ["ReproSettings", "seed_everything"]

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


def seed_everything(
    seed: int, *, deterministic: bool = False, benchmark: bool | None = None
) -> ReproSettings:
    """Seed Python, NumPy (if installed) and torch on every device; optionally go deterministic.

    ``deterministic=True`` turns on ``torch.use_deterministic_algorithms`` (ops without a
    deterministic implementation then raise), sets ``cudnn.deterministic``, turns cuDNN's
    autotuner off, and sets ``CUBLAS_WORKSPACE_CONFIG`` when it is not set already.
    ``benchmark`` sets ``torch.backends.cudnn.benchmark`` explicitly (``None``: off when
    deterministic, else unchanged).

    Returns the previous settings; used as a context manager, they come back when the block ends.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidArgumentError(
            f"seed={seed!r} is not an integer.", hint="Pass a whole number such as 0 or 1234."
        )
    if not 0 <= seed <= _MAX_SEED:
        raise InvalidArgumentError(
            f"seed={seed} is outside 0..{_MAX_SEED}, the range every generator accepts.",
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
