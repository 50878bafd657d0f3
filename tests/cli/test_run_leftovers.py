"""``gpukit run`` holds its claims until the last process its command started has ended.

A command may end before processes it started: ``sh -c 'train &'``, or torchrun killed while its
workers (each in a session of its own) run on. Those processes become gpukit's children (it is
their subreaper) instead of init's, and gpukit waits for them, passing signals on, before it
releases the GPUs they may still be using.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpukit.sharing.claims import current_claims
from tests.helpers import MACHINES, ROOT

L4 = MACHINES / "server-4xL4-idle.json"

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="a subreaper is a Linux feature"
)

# Left behind by its shell: notes its pid, ends when told (a file) or at SIGTERM, saying which.
# argv: a folder.
_LEFT_BEHIND = """
import os, pathlib, signal, sys, time
folder = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda n, f: ((folder / "ended").write_text("SIGTERM"), sys.exit(0)))
(folder / "tmp").write_text(str(os.getpid()))
os.replace(folder / "tmp", folder / "ready")
while not (folder / "go").exists():
    time.sleep(0.01)
(folder / "ended").write_text("go")
"""


def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        time.sleep(0.02)


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return None if fields[0] == "Z" else int(fields[1])


def _start(tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(tmp_path / "locks")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    script = tmp_path / "left.py"
    script.write_text(_LEFT_BEHIND)
    shell = f"{sys.executable} {script} {tmp_path} & exit 3"
    return subprocess.Popen(
        [sys.executable, "-m", "gpukit", "run", "--", "sh", "-c", shell],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _left_behind(tmp_path: Path, gpukit: subprocess.Popen[str]) -> int:
    """The left-behind process's pid, once its shell has ended and gpukit adopted it."""
    _until(lambda: (tmp_path / "ready").exists())
    pid = int((tmp_path / "ready").read_text())
    _until(lambda: _parent(pid) == gpukit.pid)  # its shell is gone: gpukit is its parent now
    return pid


def _clean_up(gpukit: subprocess.Popen[str], tmp_path: Path) -> None:
    if (tmp_path / "ready").exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int((tmp_path / "ready").read_text()), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(gpukit.pid, signal.SIGKILL)
    gpukit.communicate(timeout=30)


def test_the_claim_lasts_until_a_process_the_command_left_behind_has_ended(
    tmp_path: Path,
) -> None:
    gpukit = _start(tmp_path)
    try:
        pid = _left_behind(tmp_path, gpukit)
        assert gpukit.poll() is None
        assert len(current_claims(tmp_path / "locks")) == 1
        (tmp_path / "go").touch()
        _, stderr = gpukit.communicate(timeout=30)
        assert gpukit.returncode == 3  # the command's own exit status, not the leftover's
        assert _parent(pid) is None
        assert current_claims(tmp_path / "locks") == {}
        assert f"(pid {pid})" in stderr
        assert "stay claimed" in stderr
    finally:
        _clean_up(gpukit, tmp_path)


def test_a_signal_to_gpukit_reaches_a_process_the_command_left_behind(tmp_path: Path) -> None:
    gpukit = _start(tmp_path)
    try:
        _left_behind(tmp_path, gpukit)
        gpukit.send_signal(signal.SIGTERM)
        gpukit.communicate(timeout=30)
        assert (tmp_path / "ended").read_text() == "SIGTERM"
        assert current_claims(tmp_path / "locks") == {}
    finally:
        _clean_up(gpukit, tmp_path)
