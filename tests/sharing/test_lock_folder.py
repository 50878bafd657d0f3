"""One lock folder per machine: the same for every user and job, whatever their environment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpukit.errors import LockFolderError
from gpukit.sharing.lock_folder import DEFAULT_LOCK_FOLDER, lock_folder, lock_folder_choice
from tests.helpers import MACHINES, CliRunner, run_python, subprocess_env

L4 = MACHINES / "server-4xL4-idle.json"


@pytest.fixture
def config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The machine's config file (absent until a test writes it); no override in the env."""
    path = tmp_path / "etc" / "config.toml"
    path.parent.mkdir()
    monkeypatch.setenv("GPUKIT_CONFIG", str(path))
    monkeypatch.delenv("GPUKIT_LOCK_DIR", raising=False)
    return path


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    path.chmod(mode)


@pytest.mark.usefixtures("config")
def test_without_config_or_override_the_lock_folder_is_the_fixed_default() -> None:
    assert lock_folder() == DEFAULT_LOCK_FOLDER == Path("/tmp/gpukit-locks")
    assert lock_folder_choice().source == "default"


def test_the_default_lock_folder_does_not_follow_tmpdir(config: Path, tmp_path: Path) -> None:
    code = "from gpukit.sharing.lock_folder import lock_folder; print(lock_folder())"
    own_tmp = tmp_path / "my-tmp"
    own_tmp.mkdir()
    out = run_python(code, TMPDIR=str(own_tmp), GPUKIT_CONFIG=str(config), GPUKIT_LOCK_DIR=None)
    assert out.strip() == "/tmp/gpukit-locks"


def test_the_config_file_sets_the_machines_lock_folder(config: Path) -> None:
    _write(config, 'lock_dir = "/var/lib/gpukit/locks"\n')
    choice = lock_folder_choice()
    assert choice.path == Path("/var/lib/gpukit/locks")
    assert choice.source == str(config)
    assert choice.warning is None


def test_gpukit_lock_dir_overrides_the_config_and_is_warned_about(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(config, 'lock_dir = "/var/lib/gpukit/locks"\n')
    monkeypatch.setenv("GPUKIT_LOCK_DIR", "/scratch/locks")
    choice = lock_folder_choice()
    assert (choice.path, choice.machine) == (Path("/scratch/locks"), Path("/var/lib/gpukit/locks"))
    assert choice.warning is not None
    assert "not this machine's lock folder /var/lib/gpukit/locks" in choice.warning


def test_an_override_equal_to_the_machines_folder_is_not_warned_about(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUKIT_LOCK_DIR", "/tmp/gpukit-locks/")
    assert lock_folder_choice().warning is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('lock_dir = "locks"\n', "not an absolute path"),
        ("lock_dir = 5\n", "not a path in quotes"),
        ("lock_dir = /var/lib\n", "Cannot read the gpukit config"),
    ],
)
def test_a_bad_lock_dir_in_the_config_is_a_lock_folder_error(
    config: Path, text: str, message: str
) -> None:
    _write(config, text)
    with pytest.raises(LockFolderError, match=message) as caught:
        lock_folder()
    assert caught.value.exit_code == 5


def test_a_config_file_others_can_write_is_refused(config: Path) -> None:
    _write(config, 'lock_dir = "/home/eve/locks"\n', mode=0o666)
    with pytest.raises(LockFolderError, match="another user could have written it"):
        lock_folder()


def test_a_relative_override_is_refused(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_LOCK_DIR", "locks")
    with pytest.raises(LockFolderError, match="not an absolute path"):
        lock_folder()


def test_users_with_different_tmpdirs_see_each_others_claims(
    config: Path, tmp_path: Path, run_cli: CliRunner
) -> None:
    _write(config, f'lock_dir = "{tmp_path / "machine-locks"}"\n')
    tmp_a, tmp_b = tmp_path / "tmp-a", tmp_path / "tmp-b"
    tmp_a.mkdir()
    tmp_b.mkdir()
    hold = (
        "from gpukit.sharing.claims import claim; from gpukit.gpus.inventory import inventory; "
        "c = claim([inventory().gpu(0)]); print('held', flush=True); input()"
    )
    env = subprocess_env(
        TMPDIR=str(tmp_a), GPUKIT_CONFIG=str(config), GPUKIT_FAKE_NVML=str(L4), GPUKIT_LOCK_DIR=None
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == b"held"
        env_b = {"TMPDIR": str(tmp_b), "GPUKIT_CONFIG": str(config), "GPUKIT_FAKE_NVML": str(L4)}
        picked = run_cli("pick", "-n", "3", env={**env_b, "GPUKIT_LOCK_DIR": None})
    finally:
        holder.kill()
        holder.wait()
    assert picked.returncode == 0, picked.stderr
    assert picked.stdout.strip() == "1,2,3"


def test_gpukit_list_names_the_lock_folder_and_warns_about_an_override(
    config: Path, tmp_path: Path, run_cli: CliRunner
) -> None:
    env = {
        "GPUKIT_CONFIG": str(config),
        "GPUKIT_FAKE_NVML": str(L4),
        "GPUKIT_LOCK_DIR": str(tmp_path / "mine"),
    }
    table = run_cli("list", env=env)
    listed = json.loads(run_cli("list", "--json", env=env).stdout)["lock_dir"]
    assert table.returncode == 0, table.stderr
    assert f"lock folder: {tmp_path / 'mine'} (GPUKIT_LOCK_DIR)" in table.stdout
    assert "warning: GPUKIT_LOCK_DIR=" in " ".join(table.stdout.split())
    assert listed["path"] == str(tmp_path / "mine")
    assert listed["machine"] == "/tmp/gpukit-locks"
    assert "invisible" in listed["warning"]


def test_gpukit_info_names_the_lock_folder(config: Path, run_cli: CliRunner) -> None:
    _write(config, 'lock_dir = "/var/lib/gpukit/locks"\n')
    info = run_cli("info", "--json", env={"GPUKIT_CONFIG": str(config), "GPUKIT_LOCK_DIR": None})
    assert info.returncode == 0, info.stderr
    lock = json.loads(info.stdout)["lock_dir"]
    assert (lock["path"], lock["source"], lock["warning"]) == (
        "/var/lib/gpukit/locks",
        str(config),
        None,
    )


@pytest.mark.parametrize("wait", [[], ["--wait", "--timeout", "5"]], ids=["now", "wait"])
def test_gpukit_run_with_a_lock_folder_under_a_file_exits_5_without_traceback(
    tmp_path: Path, run_cli: CliRunner, wait: list[str]
) -> None:
    (tmp_path / "file").write_text("")
    env = {"GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(tmp_path / "file" / "locks")}
    done = run_cli("run", "-n", "1", *wait, "--", sys.executable, "-c", "print('ran')", env=env)
    assert done.returncode == 5, done.stderr
    assert "Traceback" not in done.stderr
    assert f"{tmp_path / 'file'} is not a folder" in done.stderr
    assert "ran" not in done.stdout


def test_gpukit_list_shows_the_gpus_and_exits_5_when_the_lock_folder_is_refused(
    tmp_path: Path, run_cli: CliRunner
) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "locks").symlink_to(tmp_path / "elsewhere")
    env = {"GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(tmp_path / "locks")}
    done = run_cli("list", env={**env, "NO_COLOR": "1"})
    assert done.returncode == 5
    assert done.stdout.count(" L4 ") == 4
    assert "error: claims unknown" in done.stdout
    assert "symbolic link" in done.stdout
    picked = run_cli("pick", env=env)
    assert picked.returncode == 5
    assert "Traceback" not in picked.stderr


@pytest.mark.parametrize(
    "text",
    ["lock_dir = " + "[" * 50_000 + "\n", "x = " + "{a = " * 5_000 + "1" + "}" * 5_000 + "\n"],
    ids=["deep-array", "deep-inline-table"],
)
def test_a_deeply_nested_config_is_a_lock_folder_error_naming_the_file(
    config: Path, run_cli: CliRunner, text: str
) -> None:
    _write(config, text)
    with pytest.raises(LockFolderError) as caught:
        lock_folder()
    assert str(config) in caught.value.message
    assert "Fix the TOML" in caught.value.hint
    done = run_cli("pick", env={"GPUKIT_FAKE_NVML": str(L4), "GPUKIT_CONFIG": str(config)})
    assert done.returncode == 5, done.stderr
    assert "Traceback" not in done.stderr


def _hung(signum: int, frame: object) -> None:
    raise AssertionError("reading the config waited for a writer of the FIFO")


def test_a_config_that_is_a_fifo_is_refused_without_waiting_for_a_writer(config: Path) -> None:
    import os
    import signal

    os.mkfifo(config)
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(10)
    try:
        with pytest.raises(LockFolderError, match="a FIFO, not a regular file"):
            lock_folder()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
