"""A test run told to stop (SIGTERM) stops, even where its interrupt is dropped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, subprocess_env

# The handler the cluster fixtures install, in a session of three tests; the first sends the
# SIGTERM from inside a garbage collector's callback, where Python drops the interrupt it raises.
_CONFTEST = """
import signal
import pytest
from tests.cluster.conftest import _stopper

@pytest.fixture(scope="session", autouse=True)
def handler(request):
    previous = signal.signal(signal.SIGTERM, _stopper(request.session))
    yield
    signal.signal(signal.SIGTERM, previous)
"""

_TESTS = """
import gc, os, signal

def test_one():
    def callback(phase, info):
        if phase == "start":
            gc.callbacks.remove(callback)
            os.kill(os.getpid(), signal.SIGTERM)
    gc.callbacks.append(callback)
    gc.collect()

def test_two():
    print("ran two")

def test_three():
    print("ran three")
"""


def test_a_sigterm_whose_interrupt_is_dropped_still_stops_the_run(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_session.py").write_text(_TESTS)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "-s",
            "-q",
            str(tmp_path / "test_session.py"),
            "--rootdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        cwd=tmp_path,
        timeout=120,
    )
    assert "ran two" not in done.stdout, done.stdout[-3000:]
    assert "ran three" not in done.stdout
    assert done.returncode != 0
