"""Running a command as this process's child so that every signal reaches it exactly once.

``gpukit run`` runs its command through :func:`supervise`; ``gpukit run --ddp``'s command is
torchrun, which passes every signal listed in :data:`FORWARDED` on to its workers (see
:func:`gpukit.distributed.torchrun.ddp_command`).

The command runs in a process group of its own. A signal sent to gpukit's group
(``kill -TERM -- -PGID``, ``timeout``, a scheduler) or to gpukit alone (``kill PID``) therefore
reaches gpukit only, and gpukit forwards it to the command's group: the command, and every
process it started (a shell script's job), gets it once. Before, the command
shared gpukit's group and got such a signal twice, once directly and once forwarded, so a job
took a second KeyboardInterrupt while saving its checkpoint.

At a terminal, the command's group is made the terminal's foreground group, so Ctrl-C, Ctrl-\\
and a hang-up reach the command (and its children) straight from the terminal, once, and it
can read the terminal. When Ctrl-Z stops it, gpukit takes the terminal back and stops too, so
the shell sees the job stopped; ``fg`` continues gpukit, which hands the terminal back and
continues the command. When gpukit dies, even by SIGKILL, the command is told to stop
(SIGTERM, Linux's parent-death signal), and so is every process of its group (by a watchdog
process), and the shell takes its terminal back.

Never imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from gpukit.errors import InvalidArgumentError

# What a user or a scheduler sends to stop, hang up, or ask a job to checkpoint (SIGUSR1,
# SIGUSR2: Slurm's --signal).
FORWARDED: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# ``timeout`` sends its signal to gpukit and then to gpukit's group: the same signal from the
# same sender twice in a row is one request, forwarded once.
_REPEAT_S = 0.5


def _controlling_terminal() -> int | None:
    """A descriptor of this process's controlling terminal, or ``None`` without one."""
    try:
        return os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None


def _foreground(tty: int | None) -> bool:
    """True when gpukit's group is the terminal's foreground group (it may hand it over).

    A shell without job control (a script) runs ``gpukit run ... &`` in its own group, the
    foreground one, with SIGINT ignored: such a gpukit is a background job and leaves the
    terminal, and the script's Ctrl-C, to the script.
    """
    if tty is None or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return False
    try:
        return os.tcgetpgrp(tty) == os.getpgrp()
    except OSError:
        return False


@contextlib.contextmanager
def _quiet_ttou() -> Iterator[None]:
    """Block SIGTTOU: a background group may then set the terminal's foreground group."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _give_terminal(tty: int | None, pgid: int) -> None:
    if tty is None:
        return
    with _quiet_ttou(), contextlib.suppress(OSError):
        os.tcsetpgrp(tty, pgid)


def _prctl() -> Callable[..., int] | None:
    """Linux's prctl(2), or ``None`` elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


def _child_setup(tty: int | None, own_group: bool) -> Callable[[], None]:
    """A function for the child, run between fork and exec: own group, terminal, signals."""
    parent = os.getpid()
    prctl = _prctl()

    def setup() -> None:
        if own_group:
            os.setpgid(0, 0)
        if tty is not None:
            # Before exec, so that the command never reads the terminal from the background
            # (which would stop it with SIGTTIN).
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
            with contextlib.suppress(OSError):
                os.tcsetpgrp(tty, os.getpgrp())
        # The blocked-signal mask survives exec: gpukit blocks the forwarded signals to read
        # them synchronously, and the command must receive them as usual.
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        if prctl is not None:
            prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: told to stop when gpukit dies
            if os.getppid() != parent:  # gpukit died before the line above took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return setup


def _cannot_run(program: str, exc: OSError) -> InvalidArgumentError:
    """The error for a program that could not be started: ``exc`` is what exec said."""
    if isinstance(exc, FileNotFoundError):
        return InvalidArgumentError(
            f"Cannot run {program!r}: no such program.", hint="Check the command after `--`."
        )
    return InvalidArgumentError(
        f"Cannot run {program!r}: {exc.strerror or exc}.",
        hint="Check the command after `--`: make the file executable (chmod +x) or run it "
        "with its interpreter, e.g. `-- python train.py`.",
    )


def check_program(program: str, env: Mapping[str, str]) -> None:
    """Refuse, before anything starts, a program that exec would not find or may not run.

    ``program`` is looked up as :func:`supervise` (``subprocess``) looks it up: a name with a
    ``/`` as that path, any other in ``env``'s ``PATH``. It must be a file you may execute:
    found nowhere is "no such program", a folder or a file without the execute permission is
    "Permission denied", the same errors :func:`supervise` gives once exec has failed. Meant
    for a command that another program starts later (torchrun's workers), whose failed exec
    would be that program's traceback. What only exec can tell (a file of a format the kernel
    does not run) is not checked.

    Raises:
        InvalidArgumentError: the program cannot be started, saying why and what to check.
    """
    if not program:
        candidates: list[str] = []
    elif os.sep in program:
        candidates = [program]
    else:  # os.get_exec_path is subprocess's own reading of PATH (an empty entry: the cwd)
        candidates = [os.path.join(folder, program) for folder in os.get_exec_path(dict(env))]
    denied = False
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return
        denied = denied or os.path.exists(path)
    if denied:
        problem: OSError = PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
    else:
        problem = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    raise _cannot_run(program, problem)


def _start(
    argv: Sequence[str], env: dict[str, str], tty: int | None, *, own_group: bool
) -> subprocess.Popen[bytes]:
    try:
        proc = subprocess.Popen(list(argv), env=env, preexec_fn=_child_setup(tty, own_group))
    except OSError as exc:  # not found, not executable (chmod), a folder, not a program
        raise _cannot_run(argv[0], exc) from exc
    if own_group:
        with contextlib.suppress(OSError):  # the child did it too; whichever runs first wins
            os.setpgid(proc.pid, proc.pid)
    return proc


def _exit_status(status: int) -> int:
    """The shell's ``$?`` for a wait status: the exit code, or 128+N for signal N."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def supervise(
    argv: Sequence[str],
    env: dict[str, str],
    *,
    on_leftovers: Callable[[list[int]], None] | None = None,
) -> int:
    """Run ``argv`` to its end as this process's child, forwarding signals; return its status.

    The exit status is the command's, or 128+N when signal N ended it. On Linux this process
    is the reaper of the command's orphans (``PR_SET_CHILD_SUBREAPER``): a process the command
    started and left behind (``cmd &``, or torchrun's workers when torchrun is killed) becomes
    this process's child instead of init's, and ``supervise`` returns only once every such
    process has ended too, passing signals on to them meanwhile; ``on_leftovers`` is told their
    pids once, when the command itself has ended before them.
    """
    if not hasattr(signal, "sigtimedwait"):
        # Without synchronous signal reading (not Linux), the command stays in gpukit's group
        # and gpukit forwards what it receives, as before.
        proc = _start(argv, env, None, own_group=False)
        for signum in FORWARDED:
            signal.signal(signum, lambda s, _f: proc.send_signal(s))
        code = proc.wait()
        return 128 - code if code < 0 else code
    waited = {*FORWARDED, signal.SIGCHLD, signal.SIGCONT}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    tty = _controlling_terminal()
    ours = set(children(os.getpid()))  # this process's own children, not the command's
    try:
        with _subreaper() as reaping:
            handed = tty if _foreground(tty) else None
            proc = _start(argv, env, handed, own_group=True)
            watch = _watchdog(proc.pid)
            try:
                code = _follow(proc, tty, waited, gave_terminal=handed is not None)
                if reaping:
                    known = ours | ({watch[0]} if watch is not None else set())
                    _outlive_leftovers(waited, known, on_leftovers)
                return code
            finally:
                _stand_down(watch)
                if handed is not None:  # the command's group ended: the terminal is ours again
                    with contextlib.suppress(OSError):
                        if os.tcgetpgrp(handed) == proc.pid:
                            _give_terminal(handed, os.getpgrp())
    finally:
        if tty is not None:
            os.close(tty)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def children(pid: int) -> list[int]:
    """The pids of process ``pid``'s children, from ``/proc`` (empty where it cannot be read)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it.
        fields = stat.rpartition(b")")[2].split()
        if len(fields) > 1 and fields[1] == str(pid).encode():
            found.append(int(entry))
    return found


_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


@contextlib.contextmanager
def _subreaper() -> Iterator[bool]:
    """Make this process the reaper of its orphaned descendants while inside; True if it is."""
    prctl = _prctl()
    if prctl is None:
        yield False
        return
    import ctypes

    before = ctypes.c_int(0)
    prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(before), 0, 0, 0)
    if prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        yield False
        return
    try:
        yield True
    finally:
        prctl(_PR_SET_CHILD_SUBREAPER, before.value, 0, 0, 0)


def _outlive_leftovers(
    waited: set[signal.Signals],
    known: set[int],
    on_leftovers: Callable[[list[int]], None] | None,
) -> None:
    """Wait until every process the command left behind has ended, passing signals on to them.

    They are this process's children now (it is their reaper); ``known`` are the children it
    had anyway (the watchdog). Each is reaped as it ends; its own orphans become children in
    turn and are waited for too.
    """
    told = False
    last: tuple[int, int, float] | None = None
    while left := [pid for pid in children(os.getpid()) if pid not in known]:
        if not told and on_leftovers is not None:
            on_leftovers(left)
        told = True
        info = signal.sigtimedwait(waited, 0.25)
        if info is not None and info.si_signo in FORWARDED:
            now = time.monotonic()
            again = last is not None and last[:2] == (info.si_signo, info.si_pid)
            if not (again and last is not None and now - last[2] < _REPEAT_S):  # timeout's two
                for pid in left:
                    _signal_group_of(pid, info.si_signo)
            last = (info.si_signo, info.si_pid, now)
        for pid in left:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def _signal_group_of(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group of ``pid`` (to ``pid`` alone if that is ours)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        group = os.getpgid(pid)
        if group == os.getpgrp():
            os.kill(pid, signum)
        else:
            os.killpg(group, signum)


def _watchdog(pgid: int) -> tuple[int, int] | None:
    """Start a process that sends SIGTERM to the group ``pgid`` if gpukit dies first.

    The parent-death signal reaches the command alone; the processes it started (a shell
    script's job) would outlive a gpukit killed with SIGKILL, on GPUs no longer claimed. The
    watchdog, in a session of its own (no terminal's or group's signal reaches it), waits for
    the end of a pipe that only gpukit holds. Returns (its pid, the pipe's end), or ``None``.
    """
    try:
        read_end, write_end = os.pipe()
    except OSError:
        return None
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return None
    if pid == 0:  # the watchdog: nothing here may raise past os._exit
        try:
            # Nothing of gpukit's but the pipe: a lock file's descriptor kept here would hold
            # its claim until the watchdog ends.
            os.closerange(0, read_end)
            os.closerange(read_end + 1, os.sysconf("SC_OPEN_MAX"))
            os.setsid()
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            while True:
                try:
                    told = os.read(read_end, 1)
                    break
                except InterruptedError:
                    continue
            if not told:  # gpukit died without standing the watchdog down
                with contextlib.suppress(OSError):
                    os.killpg(pgid, signal.SIGTERM)
        finally:
            os._exit(0)
    os.close(read_end)
    return pid, write_end


def _stand_down(watch: tuple[int, int] | None) -> None:
    """Tell the watchdog that gpukit saw its command end, and reap it."""
    if watch is None:
        return
    pid, write_end = watch
    with contextlib.suppress(OSError):
        os.write(write_end, b"x")
    os.close(write_end)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _follow(
    proc: subprocess.Popen[bytes],
    tty: int | None,
    waited: set[signal.Signals],
    *,
    gave_terminal: bool,
) -> int:
    last: tuple[int, int, float] | None = None
    stopped = False
    while True:
        info = signal.sigtimedwait(waited, 0.25)
        if info is not None and info.si_signo in FORWARDED:
            now = time.monotonic()
            repeat = last is not None and last[:2] == (info.si_signo, info.si_pid)
            again = repeat and last is not None and now - last[2] < _REPEAT_S
            # A hang-up reached the command straight from the kernel only if its group was
            # the terminal's foreground one; a background gpukit passes it on.
            if not again and not (gave_terminal and _hung_up(info.si_signo, tty)):
                # To the command's whole group, as a terminal would: a shell script's job is
                # the shell's child and must stop with it, not outlive the claim.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, info.si_signo)
            last = (info.si_signo, info.si_pid, now)
        elif info is not None and info.si_signo == signal.SIGCONT and stopped:
            # Continued (fg or bg) after following the command's stop: take it along.
            if _foreground(tty):
                _give_terminal(tty, proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
            stopped = False
        pid, status = os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)
        if pid == 0:
            continue
        if os.WIFSTOPPED(status):
            if tty is not None:  # Ctrl-Z (or a read from the background): the job stops
                stopped = True
                _give_terminal(tty, os.getpgrp())
                os.killpg(os.getpgrp(), signal.SIGTSTP)
            continue
        code = _exit_status(status)
        proc.returncode = 128 - code if os.WIFSIGNALED(status) else code  # Popen's convention
        return code


def _hung_up(signum: int, tty: int | None) -> bool:
    """True for a SIGHUP of a terminal that hung up: the kernel sent the command its own."""
    if signum != signal.SIGHUP or tty is None:
        return False
    try:
        os.tcgetpgrp(tty)
    except OSError:
        return True
    return False
