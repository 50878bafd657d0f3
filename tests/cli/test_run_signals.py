"""``gpukit run`` passes every signal to its command exactly once, and keeps job control.

The command counts the signals it receives and, after the first, lingers a moment so that a
second copy (the bug these tests guard against) would be counted too, then writes the count.
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

from tests.helpers import MACHINES, ROOT

L4 = MACHINES / "server-4xL4-idle.json"

pytestmark = pytest.mark.skipif(
    not hasattr(signal, "sigtimedwait"), reason="signals are passed on this way only on Linux"
)

# argv: ready-file, result-file. Counts SIGINT/SIGTERM deliveries (the wakeup fd gets a byte
# for each, where Python would run a handler once for two that arrive close together); exits
# 5 half a second after the first.
_COUNTER = """
import os, pathlib, signal, sys, time
ready, result = map(pathlib.Path, sys.argv[1:3])
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w)
signal.signal(signal.SIGINT, lambda n, f: None)
signal.signal(signal.SIGTERM, lambda n, f: None)
ready.write_text(str(os.getpgrp()))
got = os.read(r, 64)
end = time.monotonic() + 0.5
os.set_blocking(r, False)
while time.monotonic() < end:
    time.sleep(0.01)
    try:
        got += os.read(r, 64)
    except BlockingIOError:
        pass
result.write_text(" ".join(signal.Signals(n).name for n in got))
sys.exit(5)
"""

# Like `timeout`: gpukit runs in this process's group; on cue, the signal goes to gpukit and
# then to the whole group. argv: signal number, ready-file, gpukit arguments...
_LIKE_TIMEOUT = """
import os, pathlib, signal, subprocess, sys, time
signum, ready = int(sys.argv[1]), pathlib.Path(sys.argv[2])
signal.signal(signum, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-m", "gpukit", *sys.argv[3:]])
while not (ready.exists() and ready.read_text()):
    time.sleep(0.01)
os.kill(child.pid, signum)
os.killpg(0, signum)
sys.exit(child.wait())
"""


def _env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(tmp_path / "locks")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        time.sleep(0.02)


def _counter(tmp_path: Path) -> tuple[list[str], Path, Path]:
    ready, result = tmp_path / "ready", tmp_path / "result"
    return ["run", "--", sys.executable, "-c", _COUNTER, str(ready), str(result)], ready, result


def _reap(proc: subprocess.Popen[bytes], ready: Path) -> None:
    """Leave nothing running when a test fails midway: gpukit and its command's group."""
    if ready.exists() and ready.read_text().strip():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(ready.read_text()), signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_a_signal_to_gpukits_whole_process_group_reaches_the_command_once(
    tmp_path: Path,
) -> None:
    args, ready, result = _counter(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpukit", *args], env=_env(tmp_path), start_new_session=True
    )
    try:
        _until(lambda: ready.exists() and ready.read_text() != "")
        # In gpukit's group, the command would get the group's signal and gpukit's copy of it
        # (or one, when the two happen to arrive together): it has a group of its own.
        assert int(ready.read_text()) != proc.pid
        os.killpg(proc.pid, signal.SIGTERM)  # kill -TERM -- -PGID
        assert proc.wait(timeout=30) == 5
    finally:
        _reap(proc, ready)
    assert result.read_text() == "SIGTERM"


def test_a_signal_from_timeout_to_gpukit_and_its_group_reaches_the_command_once(
    tmp_path: Path,
) -> None:
    args, ready, result = _counter(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", _LIKE_TIMEOUT, str(int(signal.SIGINT)), str(ready), *args],
        env=_env(tmp_path),
        start_new_session=True,
    )
    try:
        assert proc.wait(timeout=30) == 5
    finally:
        _reap(proc, ready)
    assert result.read_text() == "SIGINT"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_gpukit_alone_reaches_the_command_once(tmp_path: Path, signum: int) -> None:
    args, ready, result = _counter(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "gpukit", *args], env=_env(tmp_path))
    try:
        _until(lambda: ready.exists() and ready.read_text() != "")
        proc.send_signal(signum)  # kill PID
        assert proc.wait(timeout=30) == 5
    finally:
        _reap(proc, ready)
    assert result.read_text() == signal.Signals(signum).name


def test_a_signal_to_gpukit_reaches_the_processes_its_command_started(tmp_path: Path) -> None:
    # `gpukit run -- bash train.sh`: the training process is the shell's child. Passed to the
    # shell alone, a TERM ends the shell and leaves the job running on a GPU no longer claimed.
    args, ready, result = _counter(tmp_path)
    shell = ["sh", "-c", '"$@"; exit $?', "sh", *args[2:]]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "run", "--", *shell], env=_env(tmp_path)
    )
    _until(lambda: ready.exists() and ready.read_text() != "")
    try:
        proc.send_signal(signal.SIGTERM)  # kill PID, as a scheduler does
        proc.wait(timeout=30)
        _until(result.exists, timeout=10)
        assert result.read_text() == "SIGTERM"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(ready.read_text()), signal.SIGKILL)


def test_when_gpukit_is_killed_the_processes_its_command_started_are_told_to_stop(
    tmp_path: Path,
) -> None:
    # kill -9 of gpukit frees its GPUs at once: a job left running under a shell would use a
    # GPU that the next claimer is given.
    args, ready, result = _counter(tmp_path)
    shell = ["sh", "-c", '"$@"; exit $?', "sh", *args[2:]]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "run", "--", *shell], env=_env(tmp_path)
    )
    _until(lambda: ready.exists() and ready.read_text() != "")
    try:
        proc.kill()
        proc.wait(timeout=30)
        _until(result.exists, timeout=10)
        assert result.read_text() == "SIGTERM"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(ready.read_text()), signal.SIGKILL)


# A tiny job-control shell on a pseudo-terminal: runs gpukit as a foreground job, reports
# "stopped" when the job stops, and puts it back in the foreground on SIGUSR1 (as `fg`).
# argv: log-file, gpukit arguments...
_SHELL = """
import fcntl, os, pathlib, signal, sys, termios
log = pathlib.Path(sys.argv[1])
os.setsid()
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
for s in (signal.SIGTTOU, signal.SIGTTIN, signal.SIGTSTP):
    signal.signal(s, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
pid = os.fork()
if pid == 0:
    os.setpgid(0, 0)
    os.tcsetpgrp(0, os.getpgrp())
    for s in (signal.SIGTTOU, signal.SIGTTIN, signal.SIGTSTP):
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    os.execv(sys.executable, [sys.executable, "-m", "gpukit", *sys.argv[2:]])
try:  # as shells do: the child may have set its group and run gpukit already
    os.setpgid(pid, pid)
except PermissionError:
    pass
os.tcsetpgrp(0, pid)
while True:
    _, status = os.waitpid(pid, os.WUNTRACED)
    if os.WIFSTOPPED(status):
        with log.open("a") as f:
            f.write("stopped\\n")
        signal.sigwait({signal.SIGUSR1})
        os.tcsetpgrp(0, pid)
        os.killpg(pid, signal.SIGCONT)
        continue
    os.tcsetpgrp(0, os.getpgrp())
    with log.open("a") as f:
        f.write(f"exit {os.waitstatus_to_exitcode(status)}\\n")
    break
"""

# Reads a line from the terminal, logs it, then counts SIGINTs as _COUNTER does, or reads a
# second line when told to by argv[2] == "read".
_TERMINAL_JOB = """
import pathlib, signal, sys, time
log, then = pathlib.Path(sys.argv[1]), sys.argv[2]
def note(text):
    with log.open("a") as f:
        f.write(text + "\\n")
note("read " + input())
if then == "read":
    note("read " + input())
    sys.exit(0)
got = []
signal.signal(signal.SIGINT, lambda n, f: got.append(n))
note("ready")
while not got:
    time.sleep(0.01)
end = time.monotonic() + 0.5
while time.monotonic() < end:
    time.sleep(0.01)
note(f"got {len(got)}")
sys.exit(5)
"""


def _on_terminal(tmp_path: Path, then: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    log = tmp_path / "log"
    log.touch()
    master, slave = os.openpty()
    args = ["run", "--", sys.executable, "-c", _TERMINAL_JOB, str(log), then]
    shell = subprocess.Popen(
        [sys.executable, "-c", _SHELL, str(log), *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=_env(tmp_path),
    )
    os.close(slave)
    return shell, master, log


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines()


def test_ctrl_c_at_a_terminal_reaches_the_command_once_and_it_can_read_the_terminal(
    tmp_path: Path,
) -> None:
    shell, master, log = _on_terminal(tmp_path, "count")
    try:
        os.write(master, b"hello\n")
        _until(lambda: "ready" in _lines(log))
        os.write(master, b"\x03")  # Ctrl-C
        assert shell.wait(timeout=30) == 0
        assert _lines(log) == ["read hello", "ready", "got 1", "exit 5"]
    finally:
        os.close(master)
        shell.kill()
        shell.wait()


def test_ctrl_z_stops_the_job_and_fg_gives_the_command_back_its_terminal(
    tmp_path: Path,
) -> None:
    shell, master, log = _on_terminal(tmp_path, "read")
    try:
        os.write(master, b"one\n")
        _until(lambda: "read one" in _lines(log))
        os.write(master, b"\x1a")  # Ctrl-Z: the shell must see gpukit's job stop
        _until(lambda: "stopped" in _lines(log))
        shell.send_signal(signal.SIGUSR1)  # fg
        os.write(master, b"two\n")
        assert shell.wait(timeout=30) == 0
        assert _lines(log) == ["read one", "stopped", "read two", "exit 0"]
    finally:
        os.close(master)
        shell.kill()
        shell.wait()


# A script on a terminal that runs gpukit in the background as a shell without job control
# does (`gpukit run ... &` in a script): in the script's own process group, with SIGINT and
# SIGQUIT ignored. argv: gpukit arguments...
_SCRIPT = """
import fcntl, os, signal, subprocess, sys, termios
os.setsid()
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
def background():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
job = subprocess.Popen([sys.executable, "-m", "gpukit", *sys.argv[1:]], preexec_fn=background)
sys.exit(job.wait())
"""

_WHERE = """
import os, sys
with open(sys.argv[1], "a") as f:
    f.write("foreground" if os.tcgetpgrp(0) == os.getpgrp() else "background")
"""


def test_a_background_gpukit_leaves_the_terminal_to_the_script_that_started_it(
    tmp_path: Path,
) -> None:
    # Given the terminal, the background job's command would get the script's Ctrl-C, and the
    # script and its foreground commands would not.
    log = tmp_path / "log"
    master, slave = os.openpty()
    args = ["run", "--", sys.executable, "-c", _WHERE, str(log)]
    script = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=_env(tmp_path),
    )
    os.close(slave)
    try:
        assert script.wait(timeout=30) == 0
        assert log.read_text() == "background"
    finally:
        os.close(master)
        script.kill()
        script.wait()


_HUP = """
import os, signal, sys, time
log = sys.argv[1]
signal.signal(signal.SIGHUP, lambda n, f: (open(log, "a").write("hup"), sys.exit(0)))
open(log, "a").write(f"ready {os.getpgrp()} ")
time.sleep(60)
"""


def test_a_background_gpukit_passes_the_terminals_hang_up_to_its_command(tmp_path: Path) -> None:
    # The kernel hangs up the terminal's foreground group, gpukit's and not its command's:
    # the command must hear of it from gpukit, as it would have without gpukit.
    log = tmp_path / "log"
    log.touch()
    master, slave = os.openpty()
    args = ["run", "--", sys.executable, "-c", _HUP, str(log)]
    script = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=_env(tmp_path),
    )
    os.close(slave)
    try:
        _until(lambda: log.read_text().startswith("ready "))
        os.close(master)  # the terminal window closes
        _until(lambda: log.read_text().endswith(" hup"))
    finally:
        with contextlib.suppress(OSError):
            os.close(master)
        script.kill()
        script.wait()
        with contextlib.suppress(ProcessLookupError, ValueError, IndexError):
            os.killpg(int(log.read_text().split()[1]), signal.SIGKILL)
