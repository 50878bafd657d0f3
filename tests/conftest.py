"""The suite's fixtures and hooks; what tests import lives in ``tests/helpers``."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from hypothesis import settings

from tests.helpers import MACHINES, CliRunner, cuda_devices, subprocess_env

# The checkpoint tests still import these from here; they move to tests.helpers with them.
from tests.helpers import NOBODY as NOBODY
from tests.helpers import as_root as as_root

# No per-example deadline: on a busy machine a slow example is not a failing one, and a test that
# fails by the clock alone is a flaky test.
settings.register_profile("gpukit", deadline=None)
settings.load_profile("gpukit")


def _still_ignored(signum: int, frame: FrameType | None) -> None:
    """Ignore the signal here, as the runner asked, without passing that on through exec."""


def pytest_configure(config: pytest.Config) -> None:
    """Give the commands the tests start the signal defaults of a terminal.

    Started in the background by a script (``pytest &``) or under ``nohup``, pytest inherits
    SIGINT or SIGHUP ignored, and so would every command a test starts: Ctrl-C, ``--watch``'s
    interruption and a hang-up would never reach them, and the tests of those would fail for
    the runner's sake, not gpukit's. A handler that does nothing still ignores the signal in
    pytest itself, and exec resets it to the default in each command.
    """
    for signum in (signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_IGN:
            signal.signal(signum, _still_ignored)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked by :func:`tests.helpers.needs_gpus` where too few GPUs exist."""
    marker = item.get_closest_marker("needs_gpus")
    if marker is None:
        return
    wanted = marker.args[0] if marker.args else 1
    found = cuda_devices()
    if found < wanted:
        pytest.skip(
            f"needs {wanted} CUDA device{'s' if wanted != 1 else ''}; this machine has {found}"
        )


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """Undo every change a test makes to ``os.environ``.

    Library calls such as ``gk.set_visible_devices`` write the environment themselves, and
    ``monkeypatch.delenv`` of a variable that was not set records nothing to undo, so without
    this one test's ``CUDA_VISIBLE_DEVICES`` would reach every later test.
    """
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _restore_torch_switches() -> Iterator[None]:
    """Undo every change a test makes to torch's process-wide switches.

    A training workload run in-process turns on deterministic algorithms, a benchmark pins the
    thread count: without this, whichever test the random order runs next inherits them, and a
    test of ``gk.seed_everything`` that reads "the settings before" reads another test's.
    """
    import torch

    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.get_default_dtype(),
        torch.get_num_threads(),
    )
    yield
    deterministic, warn_only, cudnn_deterministic, cudnn_benchmark, dtype, threads = saved
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.deterministic = cudnn_deterministic
    torch.backends.cudnn.benchmark = cudnn_benchmark
    torch.set_default_dtype(dtype)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@functools.cache
def _real_cuda_devices() -> int:
    """The CUDA devices torch counts here (through NVML: the driver is not started)."""
    import torch

    return int(torch.cuda.device_count())


def _shown_no_cuda(item: pytest.Item) -> bool:
    """Whether ``item`` runs as on a machine without CUDA although this one has some."""
    return _real_cuda_devices() > 0 and item.get_closest_marker("gpu") is None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Show a ``cpu_workers`` test's processes no GPU, those of module fixtures included."""
    hide = _shown_no_cuda(item) and item.get_closest_marker("cpu_workers") is not None
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        return (yield)
    finally:
        if hide and saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        elif hide and saved is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


@pytest.fixture(autouse=True)
def _a_machine_without_cuda(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, _no_inherited_grant: None
) -> None:
    """Show every test not marked ``gpu`` the machine it was written for: one without CUDA.

    The suite states what gpukit does on a CPU machine: ``device("auto")`` is the CPU, a model
    ``prepare`` moves stays comparable with CPU tensors, ``launch(fn, 2)`` runs gloo on the CPU.
    On a GPU machine torch would answer otherwise for tests that never meant to ask it; this
    makes it answer as on the CPU machine, and the tests marked ``gpu`` see the GPUs. A test
    marked ``cpu_workers`` starts processes of its own, which are shown no GPU either
    (``CUDA_VISIBLE_DEVICES`` empty). Where torch counts no CUDA device this does nothing.
    """
    if not _shown_no_cuda(request.node):
        return
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    if request.node.get_closest_marker("cpu_workers") is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A temporary folder another user can reach (pytest's own are private to their owner)."""
    path = Path(tempfile.mkdtemp(prefix="gpukit-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


# Variables that restrict which GPUs gpukit chooses among, or describe a job it runs in: a test
# that needs one sets it, and none leaks from the shell (a GPU server, a Slurm job) or from a
# test that set it without monkeypatch (set_visible_devices writes os.environ itself).
JOB_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS")


@pytest.fixture(autouse=True)
def _no_inherited_grant(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in JOB_VARIABLES:
        # setenv first, so that monkeypatch restores the variable's absence even when the
        # test sets it behind monkeypatch's back.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture
def machines_dir() -> Path:
    """The folder of machine descriptions (what NVML reports on real machines)."""
    return MACHINES


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
        return subprocess.run(
            [sys.executable, "-m", "gpukit", *args],
            capture_output=True,
            text=True,
            env=subprocess_env(**(env or {})),
            timeout=timeout,
            input=input,
            check=False,
        )

    return run


@pytest.fixture
def alarm() -> Iterator[None]:
    """Fail (instead of hanging the test run) if the code under test blocks for 30 seconds."""

    def fail(signum: int, frame: FrameType | None) -> None:
        raise AssertionError("blocked")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def cuda_not_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process has not started CUDA (even where an earlier test on a GPU machine did)."""
    import gpukit.gpus.visible as visible

    monkeypatch.setattr(visible, "cuda_started", lambda *, by_torch=False: False)
