"""What the tests share, in one place: paths, fresh processes, markers for what a test needs.

Fixtures live in ``tests/conftest.py`` (pytest finds them there); whatever a test imports lives
here: ``from tests.helpers import ROOT, MACHINES, run_python, needs_gpus``. ``two_processes``
(a real gloo group of two), ``refcycles`` (cyclic garbage) and ``hosts`` (fake ssh hosts) are
the helpers big enough for a module of their own.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
"""The checkout: the folder that holds ``src/`` and ``tests/``."""
MACHINES = ROOT / "src" / "gpukit" / "gpus" / "machines"
"""The machine descriptions gpukit ships: the files ``GPUKIT_FAKE_NVML=<name>`` reads."""

_F = TypeVar("_F", bound=Callable[..., object])


@functools.cache
def cuda_devices() -> int:
    """How many CUDA devices torch sees (asked once, and only for a test that needs one)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int = 1) -> Callable[[_F], _F]:
    """Mark a test ``gpu``, and skip it, saying so, where fewer than ``n`` CUDA devices exist.

    The one way a test says it needs GPUs. The count is asked when the test is about to run
    (``tests/conftest.py``), never while the suite is collected: collecting starts no CUDA.
    """

    def mark(test: _F) -> _F:
        marked: _F = pytest.mark.gpu(pytest.mark.needs_gpus(n)(test))
        return marked

    return mark


def subprocess_env(**extra: str | None) -> dict[str, str]:
    """The current environment, with this checkout's ``src`` first on PYTHONPATH.

    ``extra`` entries are added, or removed when None.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("GPUKIT_FAKE_NVML", None)
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_python(code: str, **extra_env: str | None) -> str:
    """Run ``python -c code`` in a fresh process with this checkout importable; return stdout."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=subprocess_env(**extra_env),
        check=True,
        timeout=120,
    ).stdout


CliRunner = Callable[..., subprocess.CompletedProcess[str]]

NOBODY = 65534
"""The uid a test acts as when it plays another user of the machine (needs root)."""
as_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to act as another user (uid 65534)"
)

BENCH_EXTRA = frozenset({"accelerate", "lightning", "matplotlib", "nvitop", "gpustat"})


def skip_without_bench_extra(exc: ImportError) -> None:
    """Skip when ``exc`` says a package of the ``bench`` extra is missing; else re-raise it."""
    name = (exc.name or "").partition(".")[0]
    if name not in BENCH_EXTRA:
        raise exc
    pytest.skip(f"{name} is not installed (pip install 'gpukit[bench]')")
