"""Rule: a file in a folder others can write is opened without following a link, without
blocking on a FIFO, and checked to be a regular file before anything is read."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpukit.untrusted import InvalidInput, open_regular, read_file


@pytest.fixture
def alarm() -> Iterator[None]:
    """Fail, rather than hang the suite, if an open blocks."""

    def _hung(signum: int, frame: object) -> None:
        raise AssertionError("the open blocked")

    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_symbolic_link_is_refused_not_followed(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("mine")
    (tmp_path / "record").symlink_to(tmp_path / "secret")
    with pytest.raises(InvalidInput, match="symbolic link"):
        read_file(tmp_path / "record", 100)


def test_a_link_is_followed_only_when_the_caller_accepts_links(tmp_path: Path) -> None:
    (tmp_path / "blob").write_text("weights")
    (tmp_path / "snapshot").symlink_to(tmp_path / "blob")
    assert read_file(tmp_path / "snapshot", 100, follow=True) == b"weights"


def test_a_fifo_is_refused_without_blocking(tmp_path: Path, alarm: None) -> None:
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(InvalidInput, match="FIFO"):
        read_file(tmp_path / "config.json", 100)


def test_a_link_to_a_fifo_is_refused_without_blocking(tmp_path: Path, alarm: None) -> None:
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "pipe")
    with pytest.raises(InvalidInput, match="FIFO"):
        read_file(tmp_path / "model.safetensors", 100, follow=True)


def test_a_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "record").mkdir()
    with pytest.raises(InvalidInput, match="folder"):
        open_regular(tmp_path / "record")


def test_a_device_is_refused(alarm: None) -> None:
    with pytest.raises(InvalidInput, match="character device"):
        open_regular("/dev/zero", follow=True)


def test_a_hard_linked_file_is_refused_where_one_link_is_required(tmp_path: Path) -> None:
    (tmp_path / "theirs").write_text("{}")
    os.link(tmp_path / "theirs", tmp_path / "record")
    with pytest.raises(InvalidInput, match="2 links"):
        read_file(tmp_path / "record", 100, nlink=True)
    assert read_file(tmp_path / "record", 100) == b"{}"


def test_a_name_is_opened_relative_to_a_checked_folder(tmp_path: Path) -> None:
    (tmp_path / "record").write_text("ok")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert read_file("record", 10, dir_fd=dir_fd) == b"ok"
    finally:
        os.close(dir_fd)


def test_a_missing_file_is_left_to_the_caller(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "absent")


def test_the_descriptor_does_not_leak_when_the_check_fails(tmp_path: Path) -> None:
    (tmp_path / "record").mkdir()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(InvalidInput):
            open_regular(tmp_path / "record")
    assert len(os.listdir("/proc/self/fd")) == before
