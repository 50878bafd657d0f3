"""Rule: an output named long before it is written lands in one step, by descriptor."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpukit.output import write_output


def test_a_link_at_the_name_is_replaced_and_its_target_left_untouched(tmp_path: Path) -> None:
    mine = tmp_path / "bashrc"
    mine.write_text("keep me")
    out = tmp_path / "out.json"
    out.symlink_to(mine)
    write_output(out, b"{}")
    assert mine.read_text() == "keep me"
    assert not out.is_symlink()
    assert out.read_bytes() == b"{}"


def test_a_fifo_at_the_name_is_replaced_without_being_opened(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    os.mkfifo(out)
    write_output(out, b"{}")  # opening the FIFO to write would block here for ever
    assert stat.S_ISREG(out.lstat().st_mode)
    assert out.read_bytes() == b"{}"


def test_an_existing_file_is_replaced_whole_and_no_temporary_file_is_left(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.png"
    out.write_bytes(b"x" * 1000)
    write_output(out, b"new")
    assert out.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png"]


def test_a_folder_at_the_name_is_refused_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    (tmp_path / "out.png").mkdir()
    with pytest.raises(IsADirectoryError):
        write_output(tmp_path / "out.png", b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png"]


def test_a_name_without_a_folder_is_written_in_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_output("here.json", b"[]")
    assert (tmp_path / "here.json").read_bytes() == b"[]"
