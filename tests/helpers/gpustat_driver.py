"""Real gpustat, reading a described machine: the reference ``--format gpustat`` is held to.

gpustat's own query (``GPUStatCollection.new_query``) and printer (``print_json``) run unchanged;
only the NVML module they call is gpukit's :class:`~gpukit.gpus.fake_nvml.FakeNvml`, patched as
``gpustat/nvml.py`` patches pynvml (its ``nvmlDeviceGetMemoryInfo`` asks the v2 query first).
Processes are read by gpustat itself, with psutil, from this machine: a described pid is seen
only where it is a real process here, which :func:`sleepers` and :func:`described_here` provide.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from gpukit.gpus.fake_nvml import FakeNvml
from gpukit.gpus.inventory import _proc_owner_and_command
from tests.helpers import skip_without_bench_extra


def gpustat_text(description: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> str:
    """What ``gpustat --json`` prints for the machine ``description`` describes.

    Skips the test, saying why, where gpustat (the ``bench`` extra) is not installed.
    """
    try:
        import gpustat.core
        import gpustat.nvml
    except ImportError as exc:
        skip_without_bench_extra(exc)
    fake = FakeNvml(description)
    patch = gpustat.nvml.pynvml_monkeypatch
    # What gpustat/nvml.py does to pynvml at import, done to the fake.
    monkeypatch.setattr(
        patch, "original_nvmlDeviceGetMemoryInfo", staticmethod(fake.nvmlDeviceGetMemoryInfo)
    )
    monkeypatch.setattr(patch, "has_memoryinfo_v2", True)  # only read for a pynvml without v2
    monkeypatch.setattr(fake, "nvmlDeviceGetMemoryInfo", patch.nvmlDeviceGetMemoryInfo)
    monkeypatch.setattr(gpustat.nvml, "pynvml", fake)
    monkeypatch.setattr(gpustat.core, "N", fake)
    # gpustat keeps a psutil.Process per pid for the life of the process: start afresh.
    monkeypatch.setattr(gpustat.core.GPUStatCollection, "global_processes", {})
    out = io.StringIO()
    gpustat.core.GPUStatCollection.new_query().print_json(out)
    return out.getvalue()


def described_here(pid: int) -> dict[str, Any]:
    """A machine description's ``user`` and ``name`` for ``pid``, a process of this machine,
    as gpukit's inventory reads them from ``/proc`` (the process truthfully described)."""
    user, command = _proc_owner_and_command(pid)
    return {"pid": pid, "user": user, "name": command}


@contextmanager
def sleepers(argvs: Sequence[Sequence[str | bytes]]) -> Iterator[list[int]]:
    """Start one Python process per argument list, each idle once started; yield their pids.

    Each runs ``python -c <sleep> ARGS...``, so ``ARGS`` are its real command line's tail (any
    bytes), and is idle (0 % CPU, steady memory) by the time its pid is yielded.
    """
    code = "import sys, time; print('ready', flush=True); time.sleep(600)"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
        for argv in argvs
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"ready\n"
        yield [proc.pid for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
