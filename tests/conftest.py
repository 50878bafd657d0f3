"""Shared test helpers: the machine fixtures and a way to run the ``gpukit`` command."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MACHINES = Path(__file__).resolve().parent / "fixtures" / "machines"


@pytest.fixture
def machines_dir() -> Path:
    """The folder of machine descriptions (what NVML reports on real machines)."""
    return MACHINES


CliRunner = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_cli() -> CliRunner:
    """Run ``python -m gpukit ARGS`` in a subprocess, as a user would, and capture its output.

    ``env`` entries are added to (or, when None, removed from) the current environment.
    """

    def run(
        *args: str,
        env: dict[str, str | None] | None = None,
        timeout: float = 120,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "src"), *filter(None, [full_env.get("PYTHONPATH")])]
        )
        full_env.pop("GPUKIT_FAKE_NVML", None)
        for key, value in (env or {}).items():
            if value is None:
                full_env.pop(key, None)
            else:
                full_env[key] = value
        return subprocess.run(
            [sys.executable, "-m", "gpukit", *args],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout,
            input=input,
            check=False,
        )

    return run
