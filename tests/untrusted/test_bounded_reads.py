"""Rule: nothing another user controls is read past a stated number of bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpukit.untrusted import InvalidInput, parse_json, parse_toml, read_bounded, read_file


def test_a_file_within_the_limit_is_read_whole(tmp_path: Path) -> None:
    (tmp_path / "record").write_bytes(b"x" * 100)
    assert read_file(tmp_path / "record", 100) == b"x" * 100


def test_a_file_one_byte_past_the_limit_is_refused(tmp_path: Path) -> None:
    (tmp_path / "record").write_bytes(b"x" * 101)
    with pytest.raises(InvalidInput, match="larger than 100 bytes"):
        read_file(tmp_path / "record", 100)


def test_a_sparse_file_of_a_terabyte_costs_only_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "huge"
    with path.open("wb") as f:
        f.truncate(1 << 40)  # a terabyte of holes: reading it whole would never end
    with pytest.raises(InvalidInput, match="larger than"):
        read_file(path, 1 << 16)


def test_an_endless_stream_is_cut_at_the_limit() -> None:
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        with pytest.raises(InvalidInput, match="larger than 4096 bytes"):
            read_bounded(fd, 4096)
    finally:
        os.close(fd)


def test_a_stream_that_ends_at_the_limit_is_accepted() -> None:
    read_end, write_end = os.pipe()
    os.write(write_end, b"y" * 10)
    os.close(write_end)
    try:
        assert read_bounded(read_end, 10) == b"y" * 10
    finally:
        os.close(read_end)


@pytest.mark.parametrize("parse", [parse_json, parse_toml])
def test_documents_past_their_limit_are_refused_before_parsing(parse: object) -> None:
    assert callable(parse)
    with pytest.raises(InvalidInput, match="larger than 8 bytes"):
        parse(b'"123456789"', limit=8)
