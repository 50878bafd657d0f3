"""The layer's rules a reader never sees but relies on: no byte read past the limit's first,
the default bounds of each check, depth counted through lists under dotted keys, and an
output written from a folder that is no folder, under the longest name, or whose temporary
file someone else removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import termios
import threading
import time
from pathlib import Path

import pytest

from gpukit import untrusted
from gpukit.output import write_output
from gpukit.untrusted import (
    DEPTH,
    InvalidInput,
    as_dict,
    as_int,
    as_list,
    as_str,
    parse_toml,
    printable,
    read_bounded,
    read_streams,
)

# -- reading: never a byte past the first one over the limit ------------------------------------


def test_a_refused_read_stops_one_byte_past_the_limit(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 5000)
    fd = os.open(tmp_path / "big", os.O_RDONLY)
    try:
        os.read(fd, 3)  # a reader may hold a descriptor part read: the limit counts from here
        with pytest.raises(InvalidInput, match="larger than 100 bytes"):
            read_bounded(fd, 100)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 3 + 101
    finally:
        os.close(fd)


def test_a_refused_read_in_two_pieces_stops_one_byte_past_the_limit_too() -> None:
    read_end, write_end = os.pipe()
    os.write(write_end, b"a" * 40)  # the first read finds 40 bytes, the second the rest
    reader = _in_thread(lambda: _refused(read_end, 100))
    _drained(read_end)
    os.write(write_end, b"b" * 500)
    os.close(write_end)
    reader.join(30)
    try:
        assert os.read(read_end, 1000) == b"b" * (500 - 61)  # 40 + 61 = 101 bytes were taken
    finally:
        os.close(read_end)


def test_a_stream_over_its_limit_keeps_its_limit_and_one_byte_read_in_two_pieces() -> None:
    read_end, write_end = os.pipe()
    os.write(write_end, b"a" * 5)
    found: list[untrusted.Streams] = []
    reader = _in_thread(lambda: found.append(read_streams([read_end], [10], timeout=30)))
    _drained(read_end)
    os.write(write_end, b"b" * 100)
    reader.join(30)
    try:
        assert found[0].over_limit == 0
        assert found[0].data == (b"a" * 5 + b"b" * 6,)
        assert os.read(read_end, 1000) == b"b" * 94
    finally:
        os.close(read_end)
        os.close(write_end)


def _refused(fd: int, limit: int) -> None:
    with pytest.raises(InvalidInput):
        read_bounded(fd, limit)


def _in_thread(work: object) -> threading.Thread:
    thread = threading.Thread(target=work, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def _drained(fd: int) -> None:
    """Wait until a reader has taken every byte waiting in the pipe ``fd``."""
    deadline = time.monotonic() + 30
    while int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4), "little"):
        assert time.monotonic() < deadline, "the reader never read the pipe"
        time.sleep(0.005)


# -- the default bounds of each check ----------------------------------------------------------


def test_each_check_takes_4096_items_by_default_and_refuses_one_more() -> None:
    assert as_str("s" * 4096) == "s" * 4096
    assert as_list([0] * 4096) == [0] * 4096
    assert len(as_dict({str(i): i for i in range(4096)})) == 4096
    with pytest.raises(InvalidInput, match="a field is longer than 4096"):
        as_str("s" * 4097)
    with pytest.raises(InvalidInput, match="a field has more than 4096 items"):
        as_list([0] * 4097)
    with pytest.raises(InvalidInput, match="a field has more than 4096 entries"):
        as_dict({str(i): i for i in range(4097)})


def test_an_integer_is_taken_from_0_by_default() -> None:
    assert as_int(0) == 0
    with pytest.raises(InvalidInput, match="out of range"):
        as_int(-1)


def test_printable_keeps_500_characters_by_default() -> None:
    assert printable("p" * 600) == "p" * 500


# -- depth under dotted keys -------------------------------------------------------------------


def test_lists_under_dotted_keys_count_toward_the_depth_with_their_tables() -> None:
    # Dotted keys nest tables with no bracket to count in the text: the parsed document is
    # measured, every list a level.
    keys = ".".join(f"k{i}" for i in range(DEPTH - 1))
    assert parse_toml(f"{keys} = [1]", limit=1 << 20)  # the 1 at DEPTH
    with pytest.raises(InvalidInput, match=f"nested more than {DEPTH} deep"):
        parse_toml(f"{keys} = [[1]]", limit=1 << 20)  # at DEPTH + 1


# -- writing --------------------------------------------------------------------------------------


def test_an_output_under_a_fifo_named_as_its_folder_is_refused_without_opening_it(
    tmp_path: Path,
) -> None:
    os.mkfifo(tmp_path / "fifo")
    raised: list[BaseException] = []

    def write() -> None:
        try:
            write_output(tmp_path / "fifo" / "out.json", b"{}")
        except BaseException as exc:  # handed to the test's thread
            raised.append(exc)

    writer = _in_thread(write)
    writer.join(10)
    if writer.is_alive():  # blocked opening the FIFO for reading: free it, then fail
        os.close(os.open(tmp_path / "fifo", os.O_WRONLY | os.O_NONBLOCK))
        writer.join(10)
        pytest.fail("write_output opened a FIFO named as its folder and waited on it")
    assert len(raised) == 1
    assert isinstance(raised[0], NotADirectoryError)


def test_an_output_may_have_the_longest_name_a_folder_allows(tmp_path: Path) -> None:
    name = "n" * os.pathconf(tmp_path, "PC_NAME_MAX")  # its temporary name is cut to fit
    write_output(tmp_path / name, b"whole")
    assert (tmp_path / name).read_bytes() == b"whole"
    assert os.listdir(tmp_path) == [name]


def test_a_failed_write_whose_temporary_file_is_gone_raises_its_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The temporary file removed before the cleanup comes to it: the error the caller sees is
    # still the write's, not the cleanup's.
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        for entry in os.listdir(tmp_path):
            os.unlink(tmp_path / entry)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error") as raised:
        write_output(tmp_path / "out.json", b"{}")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert raised.value.errno == errno.EIO
    assert os.listdir(tmp_path) == []
