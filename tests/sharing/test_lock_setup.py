"""`gpukit setup-locks`: a lock folder only root controls, named in the machine's config."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpukit.errors import LockFolderError

# Imported here, as root: the user the tests switch to may not read this Python's own modules.
from gpukit.sharing.claims import claim, current_claims
from gpukit.sharing.lock_folder import lock_folder, read_config
from gpukit.sharing.lock_setup import setup_lock_dir
from tests.helpers import MACHINES, CliRunner

MIG = MACHINES / "server-2xH100-mig.json"
UUIDS = ["GPU-00000000-0000-0000-0000-00000000000a", "MIG-00000000-0000-0000-0000-00000000000b"]
NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="setting up a lock folder needs root")


@pytest.fixture
def root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in for / that other users can reach: etc/ for the config, var/ for the folder."""
    path = Path(tempfile.mkdtemp(prefix="gpukit-test-", dir="/tmp"))
    path.chmod(0o755)
    monkeypatch.setenv("GPUKIT_CONFIG", str(path / "etc" / "config.toml"))
    monkeypatch.delenv("GPUKIT_LOCK_DIR", raising=False)
    yield path
    shutil.rmtree(path)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_setup_makes_a_root_folder_with_root_lock_files_and_names_it_in_the_config(
    root: Path,
) -> None:
    folder = root / "var" / "locks"
    report = setup_lock_dir(folder, uuids=UUIDS)
    assert (folder.stat().st_uid, _mode(folder)) == (0, 0o1777)
    assert (folder / "queue").stat().st_uid == 0
    assert _mode(folder / "queue") == 0o1777
    for uuid in UUIDS:
        lock = folder / f"{uuid}.lock"
        assert (lock.stat().st_uid, _mode(lock)) == (0, 0o666)
    assert report.config_written
    assert lock_folder() == folder


def test_setup_keeps_the_rest_of_an_existing_config(root: Path) -> None:
    config = root / "etc" / "config.toml"
    config.parent.mkdir()
    config.write_text('[other]\nkey = "kept"\n')
    setup_lock_dir(root / "locks", uuids=[])
    assert read_config(config) == {"lock_dir": str(root / "locks"), "other": {"key": "kept"}}
    assert _mode(config) == 0o644


def test_setup_twice_changes_nothing_the_second_time(root: Path) -> None:
    setup_lock_dir(root / "locks", uuids=UUIDS)
    before = (root / "etc" / "config.toml").read_text()
    again = setup_lock_dir(root / "locks", uuids=UUIDS)
    assert not again.config_written
    assert (root / "etc" / "config.toml").read_text() == before


def test_setup_gives_a_users_existing_lock_file_to_root(root: Path) -> None:
    folder = root / "locks"
    setup_lock_dir(folder, uuids=[])
    planted = folder / f"{UUIDS[0]}.lock"
    planted.write_text("")
    os.chown(planted, NOBODY, NOBODY)
    setup_lock_dir(folder, uuids=UUIDS)
    assert planted.stat().st_uid == 0


def test_setup_refuses_a_folder_another_user_made(root: Path) -> None:
    folder = root / "locks"
    folder.mkdir()
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(LockFolderError, match="Refused to take over"):
        setup_lock_dir(folder, uuids=UUIDS)
    assert folder.stat().st_uid == NOBODY
    assert not (root / "etc" / "config.toml").exists()


def test_setup_refuses_a_place_another_user_could_swap(root: Path) -> None:
    theirs = root / "home"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(LockFolderError, match="another user could replace"):
        setup_lock_dir(theirs / "locks", uuids=UUIDS)
    assert not (theirs / "locks").exists()


def test_setup_leaves_a_config_naming_another_folder_alone(root: Path) -> None:
    config = root / "etc" / "config.toml"
    config.parent.mkdir()
    config.write_text('lock_dir = "/srv/locks"\n')
    with pytest.raises(LockFolderError, match="already sets lock_dir"):
        setup_lock_dir(root / "locks", uuids=UUIDS)
    assert config.read_text() == 'lock_dir = "/srv/locks"\n'
    assert not (root / "locks").exists()


def test_a_user_claims_gpus_in_the_root_folder(root: Path) -> None:
    folder = root / "locks"
    setup_lock_dir(folder, uuids=UUIDS)
    pid = os.fork()
    if pid == 0:  # an ordinary user of the machine
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with claim(UUIDS, command="train"):
                code = 0 if current_claims()[UUIDS[1]].command == "train" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_setup_by_another_user_than_root_is_refused(root: Path) -> None:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setuid(NOBODY)
            setup_lock_dir(root / "locks", uuids=UUIDS)
        except LockFolderError as exc:
            code = 0 if "needs root" in str(exc) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not (root / "locks").exists()


def test_the_command_makes_a_lock_file_per_gpu_and_mig_instance(
    root: Path, run_cli: CliRunner
) -> None:
    env = {"GPUKIT_FAKE_NVML": str(MIG), "GPUKIT_CONFIG": str(root / "etc" / "config.toml")}
    done = run_cli("setup-locks", str(root / "locks"), env=env)
    assert done.returncode == 0, done.stderr
    assert "4 lock file(s) owned by root" in done.stdout
    names = sorted(p.name[:4] for p in (root / "locks").glob("*.lock"))
    assert names == ["GPU-", "GPU-", "MIG-", "MIG-"]


def test_setup_refuses_a_parent_that_is_a_co_users_link_to_a_root_folder(
    root: Path, run_cli: CliRunner
) -> None:
    real = root / "real"
    real.mkdir(mode=0o755)
    link = root / "shared"
    link.symlink_to(real)
    os.lchown(link, NOBODY, NOBODY)  # whoever made the link can re-point it at their folder
    with pytest.raises(LockFolderError, match="is a symbolic link") as caught:
        setup_lock_dir(link / "locks", uuids=UUIDS)
    assert str(link) in caught.value.message
    assert "path without links" in caught.value.hint
    assert list(real.iterdir()) == []
    assert not (root / "etc" / "config.toml").exists()
    env = {"GPUKIT_CONFIG": str(root / "etc" / "config.toml")}
    done = run_cli("setup-locks", str(link / "deeper" / "locks"), env=env)
    assert done.returncode == 5, done.stderr
    assert "is a symbolic link" in done.stderr
    assert "Traceback" not in done.stderr
    assert list(real.iterdir()) == []


def test_setup_refuses_a_lock_folder_that_is_a_link_even_to_a_root_folder(root: Path) -> None:
    real = root / "real"
    real.mkdir(mode=0o755)
    (root / "locks").symlink_to(real)
    with pytest.raises(LockFolderError, match=r"locks is a symbolic link \(to "):
        setup_lock_dir(root / "locks", uuids=UUIDS)
    assert stat.S_IMODE(real.stat().st_mode) == 0o755
    assert not (root / "etc" / "config.toml").exists()
