"""A hostile co-user and the lock folder: what they plant there never touches your files."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpukit.sharing.claims as claims_module
from gpukit.errors import LockFolderError, UnsafeLockFileError
from gpukit.holders import Holder, user_name
from gpukit.sharing.claims import _read_holder, claim, current_claims
from tests.helpers import MACHINES, NOBODY, CliRunner, as_root

L4 = MACHINES / "server-4xL4-idle.json"
UUID_A = "GPU-00000000-0000-0000-0000-00000000000a"
UUID_B = "GPU-00000000-0000-0000-0000-00000000000b"


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    folder.mkdir(mode=0o1777)
    folder.chmod(0o1777)
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(L4))
    return folder


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "home" / ".bashrc"
    path.parent.mkdir()
    path.write_text("export PATH=$HOME/bin:$PATH\n")
    return path


def _hold(path: Path, record: bytes) -> int:
    """Write ``record`` into ``path`` and hold its lock, as a (hostile) claimer would."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    os.write(fd, record)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_claim_refuses_a_symlink_to_your_file_and_leaves_the_file_whole(
    locks: Path, victim: Path
) -> None:
    (locks / f"{UUID_A}.lock").symlink_to(victim)
    with pytest.raises(UnsafeLockFileError, match="symbolic link") as caught:
        claim([UUID_A]).release()
    assert caught.value.exit_code == 5
    assert victim.read_text() == "export PATH=$HOME/bin:$PATH\n"


def test_claim_refuses_a_hard_link_to_your_file_and_leaves_the_file_whole(
    locks: Path, victim: Path
) -> None:
    os.link(victim, locks / f"{UUID_A}.lock")
    with pytest.raises(UnsafeLockFileError, match="hard links"):
        claim([UUID_A]).release()
    assert victim.read_text() == "export PATH=$HOME/bin:$PATH\n"


@pytest.mark.usefixtures("alarm")
def test_a_fifo_makes_neither_claim_nor_listing_hang(locks: Path) -> None:
    os.mkfifo(locks / f"{UUID_A}.lock")
    with pytest.raises(UnsafeLockFileError, match="FIFO"):
        claim([UUID_A])
    holder = current_claims()[UUID_A]
    assert holder.problem is not None
    assert "FIFO" in holder.problem
    assert holder.describe().startswith("? (unsafe lock file")


def test_a_refused_lock_file_releases_the_gpus_claimed_before_it(locks: Path) -> None:
    os.mkfifo(locks / f"{UUID_B}.lock")
    with pytest.raises(UnsafeLockFileError):
        claim([UUID_A, UUID_B])
    assert UUID_A not in current_claims()
    claim([UUID_A]).release()  # free for the next one


def test_a_full_disk_while_writing_the_record_is_a_lock_folder_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(LockFolderError, match="No space left on device") as caught:
        claim([UUID_A])
    assert caught.value.exit_code == 5
    monkeypatch.undo()
    assert current_claims() == {}


def test_a_symlink_in_place_of_the_lock_folder_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, victim: Path
) -> None:
    link = tmp_path / "linked-locks"
    link.symlink_to(victim.parent)
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(link))
    with pytest.raises(LockFolderError, match="symbolic link"):
        claim([UUID_A])
    with pytest.raises(LockFolderError, match="symbolic link"):
        current_claims()
    assert os.listdir(victim.parent) == [".bashrc"]


@as_root
@pytest.mark.parametrize("mode", [0o777, 0o755])
def test_a_lock_folder_another_user_owns_without_the_sticky_bit_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: int
) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir()
    os.chown(folder, NOBODY, NOBODY)
    folder.chmod(mode)
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    with pytest.raises(LockFolderError, match="belongs to") as caught:
        claim([UUID_A])
    assert caught.value.exit_code == 5
    assert os.listdir(folder) == []


HOSTILE_RECORDS = [
    b'{"user": ["root"], "pid": "1; rm -rf ~", "host": 7, "command": {"a": 1}, "since": "x"}',
    b'{"user": "eve\\u001b[2J\\u001b[31m", "pid": 1e400, "command": "\\u0007run", "since": NaN}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"pid": ' + b"9" * 5000 + b"}",
    b'{"pid": ' + b"9" * 400 + b', "since": -' + b"9" * 400 + b"}",
    b'"just a string"',
    b"\xff\xfe not utf-8",
    b'{"pid": true, "since": -5, "user": ""}',
]


@pytest.mark.parametrize("record", HOSTILE_RECORDS, ids=range(len(HOSTILE_RECORDS)))
def test_a_hostile_holder_record_reads_as_the_process_that_holds_the_lock(
    locks: Path, record: bytes
) -> None:
    fd = _hold(locks / f"{UUID_A}.lock", record)
    try:
        holder = current_claims()[UUID_A]
    finally:
        os.close(fd)
    # Nothing of the record is kept: the kernel says which process holds the lock, and whose.
    assert (holder.user, holder.pid, holder.host, holder.since) == (
        user_name(os.geteuid()),
        os.getpid(),
        None,
        None,
    )
    # This process's own command line, as the kernel gives it (cut to fit a table row).
    own = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    assert holder.command is not None
    assert holder.command[:200] == own[:200]
    assert holder.describe().isprintable()
    json.dumps(holder.to_json(), allow_nan=False)


def test_control_characters_in_a_record_are_shown_as_question_marks() -> None:
    record = {"user": "eve\x1b[2J", "pid": 42, "command": "x\ny", "since": 1.5}
    holder = _read_holder(json.dumps(record).encode())
    assert holder == Holder("eve?[2J", 42, None, "x?y", 1.5)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.floats()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=10,
)
RECORDS = st.fixed_dictionaries(
    {}, optional={k: JSON for k in ("user", "pid", "host", "command", "since")}
)


@settings(max_examples=60, deadline=None)
@given(RECORDS | JSON)
def test_any_json_record_gives_a_describable_holder(value: object) -> None:
    holder = _read_holder(json.dumps(value).encode())
    text = holder.describe()
    assert text.isprintable()
    json.dumps(holder.to_json(), allow_nan=False)


def test_gpukit_list_shows_a_hostile_record_without_breaking(
    run_cli: CliRunner, locks: Path
) -> None:
    uuid = "GPU-4a1d2e10-5b7c-4f3e-9d21-0c6e8f1a2b02"  # GPU 1 of server-4xL4-idle
    fd = _hold(locks / f"{uuid}.lock", HOSTILE_RECORDS[1])
    try:
        env = {"GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(locks), "NO_COLOR": "1"}
        table = run_cli("list", env=env)
        listed = run_cli("list", "--json", env=env)
    finally:
        os.close(fd)
    assert table.returncode == 0, table.stderr
    assert "\x1b" not in table.stdout
    assert f"{user_name(os.geteuid())} (pid {os.getpid()}:" in table.stdout
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["claims"][uuid]["pid"] == os.getpid()


@as_root
def test_a_lock_file_another_user_made_private_is_a_lock_folder_error(public_tmp: Path) -> None:
    folder = public_tmp / "locks"
    folder.mkdir()
    folder.chmod(0o1777)
    private = folder / f"{UUID_A}.lock"
    private.write_text("")
    private.chmod(0o600)  # root's, and only root may open it
    pid = os.fork()
    if pid == 0:  # another user meets it
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            claim([UUID_A], folder=folder)
        except LockFolderError as exc:
            code = 0 if "permission denied" in str(exc) and exc.exit_code == 5 else 2
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert stat.S_IMODE(private.stat().st_mode) == 0o600


@as_root
@pytest.mark.parametrize(
    "wait", [[], ["--wait", "--settle", "1", "--timeout", "5"]], ids=["now", "wait"]
)
def test_gpukit_run_in_a_lock_folder_you_cannot_write_exits_5(
    public_tmp: Path, locks: Path, wait: list[str], capfd: pytest.CaptureFixture[str]
) -> None:
    from gpukit.cli.main import main

    # Run once as root first: what Python imports on the way is under root's home, which the
    # other user cannot read.
    assert main(["run", "-n", "1", *wait, "--", "true"]) == 0
    folder = public_tmp / "locks"
    folder.mkdir()
    folder.chmod(0o755)  # root's: other users may read it, not add lock files to it
    machine = public_tmp / "machine.json"
    shutil.copy(L4, machine)
    machine.chmod(0o644)
    capfd.readouterr()
    pid = os.fork()
    if pid == 0:  # an ordinary user
        code = 99
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.environ.update(GPUKIT_LOCK_DIR=str(folder), GPUKIT_FAKE_NVML=str(machine))
            code = main(["run", "-n", "1", *wait, "--", "true"])
        except BaseException:
            code = 98
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    err = capfd.readouterr().err
    assert os.waitstatus_to_exitcode(status) == 5, err
    assert "permission denied" in err
    assert "Traceback" not in err


@as_root
@pytest.mark.parametrize("named_pid", ["another", "its own"])
def test_a_holder_record_cannot_name_someone_else_as_the_holder(
    public_tmp: Path, named_pid: str
) -> None:
    # A co-user who holds a lock writes what they like in it: gpukit list, pick and run must
    # not blame root (or a colleague) for a GPU the co-user holds.
    folder = public_tmp / "locks"
    folder.mkdir()
    folder.chmod(0o1777)
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fd = os.open(folder / f"{UUID_A}.lock", os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)
            named = 1 if named_pid == "another" else os.getpid()
            record = {"user": "root", "pid": named, "command": "python train.py", "since": 5.0}
            os.write(fd, json.dumps(record).encode())
            os.write(ready_w, b"x")
            os.read(done_r, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"x"
        holder = current_claims(folder)[UUID_A]
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, done_r, done_w):
            os.close(fd)
    assert (holder.user, holder.pid) == ("nobody", pid)
    assert holder.describe().startswith(f"nobody (pid {pid}")


# -- which process the kernel says holds a lock --------------------------------------------------
# The lock table is faked so that it can name processes of every kind; the lock is really held.


def _as_written() -> Holder:
    """The holder the ``held`` lock's record names: alice, in this process."""
    return Holder("alice", os.getpid(), "gpu1", "python train.py", 1.7e9)


@pytest.fixture
def held(locks: Path) -> Iterator[int]:
    """A lock file for UUID_A, held by this process, whose record says alice holds it."""
    record = {"user": "alice", "pid": os.getpid(), "host": "gpu1", "command": "python train.py"}
    fd = _hold(locks / f"{UUID_A}.lock", json.dumps({**record, "since": 1.7e9}).encode())
    try:
        yield os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _lock_table(monkeypatch: pytest.MonkeyPatch, table: dict[int, frozenset[int]] | None) -> None:
    monkeypatch.setattr(claims_module, "exclusive_flocks", lambda: table)


@pytest.mark.parametrize("table", [None, {}], ids=["no lock table (not Linux)", "taken since"])
def test_a_lock_missing_from_the_kernels_table_is_shown_as_its_record_says(
    held: int, monkeypatch: pytest.MonkeyPatch, table: dict[int, frozenset[int]] | None
) -> None:
    _lock_table(monkeypatch, table)
    assert current_claims()[UUID_A] == _as_written()


def test_a_holder_outside_this_pid_namespace_is_shown_as_its_record_says(
    held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _lock_table(monkeypatch, {held: frozenset({0})})  # the kernel's pid 0: "not visible here"
    assert current_claims()[UUID_A] == _as_written()


def test_a_lock_that_pid_1_holds_is_shown_as_pid_1s(
    held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A container's main process is pid 1: it is a real holder, not "nobody".
    _lock_table(monkeypatch, {held: frozenset({1})})
    holder = current_claims()[UUID_A]
    assert (holder.pid, holder.host, holder.since) == (1, None, None)
    assert holder.user == user_name(os.stat("/proc/1").st_uid)


def test_where_proc_hides_the_holder_the_records_user_is_kept(
    held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Mounted with hidepid, /proc shows no other user's process: the record is all there is.
    _lock_table(monkeypatch, {held: frozenset({os.getpid()})})
    monkeypatch.setattr(claims_module, "process_uid", lambda _pid: None)
    assert current_claims()[UUID_A] == _as_written()


def test_where_proc_shows_the_holder_its_user_replaces_the_records(
    held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _lock_table(monkeypatch, {held: frozenset({os.getpid()})})
    assert current_claims()[UUID_A] == replace(_as_written(), user=user_name(os.getuid()))


@contextlib.contextmanager
def _sleeper(*args: str | bytes) -> Iterator[int]:
    """The pid of a process whose command line ends with ``args``, until the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", _SLEEP, *args], stdout=subprocess.PIPE)
    try:
        # Popen returns as exec closes the descriptors, before the kernel has set the new
        # command line (/proc reads it as empty until then): wait until the child runs.
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"up\n"
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


_SLEEP = "import time; print('up', flush=True); time.sleep(60)"
_SLEEPER = f"{sys.executable} -c {_SLEEP}"


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["x" * 600], (_SLEEPER + " " + "x" * 600)[:500]),
        ([b"caf\xe9", "au", "lait"], _SLEEPER + " caf\N{REPLACEMENT CHARACTER} au lait"),
    ],
    ids=["cut at 500 characters", "not UTF-8"],
)
def test_a_holder_the_record_does_not_name_is_shown_with_its_command_line(
    held: int, monkeypatch: pytest.MonkeyPatch, args: list[str | bytes], shown: str
) -> None:
    with _sleeper(*args) as pid:
        _lock_table(monkeypatch, {held: frozenset({pid})})
        holder = current_claims()[UUID_A]
    assert holder == Holder(user_name(os.getuid()), pid, None, shown, None)


def test_where_proc_hides_the_holder_its_user_is_unknown_not_the_records(
    held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _sleeper() as pid:
        _lock_table(monkeypatch, {held: frozenset({pid})})
        monkeypatch.setattr(claims_module, "process_uid", lambda _pid: None)
        holder = current_claims()[UUID_A]
    assert holder == Holder(None, pid, None, _SLEEPER, None)
    assert holder.describe().startswith(f"? (pid {pid}: ")


def test_a_holder_whose_command_line_cannot_be_read_has_no_command(
    held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pid above pid_max can never be running: its /proc entry cannot be read.
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    _lock_table(monkeypatch, {held: frozenset({gone})})
    holder = current_claims()[UUID_A]
    assert holder == Holder(None, gone, None, None, None)
    assert holder.describe() == f"? (pid {gone})"
