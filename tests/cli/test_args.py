"""The one checked reader of the commands' numbers, sizes, durations and output files."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpukit.cli._args import Number, OutputFile, Percent, Seconds, Size
from gpukit.cli.main import main
from gpukit.untrusted import MAX_SECONDS

HUGE = "9" * 400


@pytest.mark.parametrize(
    ("reader", "text", "expected"),
    [
        (Number(1, 10), "3", 3),
        (Number(1, 10), " 10 ", 10),
        (Number(0, 10), "+0", 0),
        (Seconds(), "0", 0.0),
        (Seconds(positive=True), "0.05", 0.05),
        (Seconds(), "1e3", 1000.0),
        (Seconds(), ".5", 0.5),
        (Percent(), "100", 100.0),
        (Percent(), "0.5", 0.5),
        (Size(), "20GiB", "20GiB"),
        (Size(), "500MB", "500MB"),
    ],
)
def test_readers_take_what_a_person_writes(reader: object, text: str, expected: object) -> None:
    assert reader(text) == expected  # type: ignore[operator]


@pytest.mark.parametrize(
    ("reader", "text"),
    [
        (Number(1, 10), "0"),
        (Number(1, 10), "11"),
        (Number(1, 10), "1.0"),
        (Number(1, 10), "²"),
        (Number(1, 10), "٣"),
        (Number(1, 10**6), HUGE),
        (Number(1, 10), ""),
        (Seconds(), "nan"),
        (Seconds(), "inf"),
        (Seconds(), "-inf"),
        (Seconds(), "1e400"),
        (Seconds(), "-1"),
        (Seconds(), HUGE),
        (Seconds(), str(MAX_SECONDS * 2)),
        (Seconds(positive=True), "0"),
        (Seconds(), "1_000"),
        (Percent(), "nan"),
        (Percent(), "101"),
        (Percent(), "-0.5"),
        (Size(), HUGE),
        (Size(), "lots"),
        (Size(), "nan"),
        (Size(), "²GiB"),
    ],
)
def test_readers_refuse_what_is_not_a_value_as_a_usage_error(reader: object, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        reader(text)  # type: ignore[operator]
    assert len(str(caught.value)) < 200  # 400 digits are not echoed back whole


@given(st.text(max_size=30))
def test_a_number_reader_returns_a_value_in_range_or_refuses(text: str) -> None:
    for reader in (Number(1, 100), Seconds(positive=True), Percent()):
        try:
            value = reader(text)
        except argparse.ArgumentTypeError:
            continue
        assert value == value  # not nan
        assert 0 <= value <= MAX_SECONDS


def test_an_output_file_must_be_in_an_existing_writable_folder(tmp_path: Path) -> None:
    (tmp_path / "folder.json").mkdir()
    assert OutputFile()(str(tmp_path / "b.json")) == str(tmp_path / "b.json")
    for bad, says in [
        (tmp_path / "folder.json", "is an existing folder"),
        (tmp_path / "missing" / "b.json", "does not exist"),
        (tmp_path / "b.json" / "c.json", "does not exist"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            OutputFile()(str(bad))


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["list", "--watch", "nan"], "--watch"),
        (["list", "--watch", "inf"], "--watch"),
        (["run", "--poll", "nan", "--", "true"], "--poll"),
        (["run", "--timeout", "1e400", "--", "true"], "--timeout"),
        (["run", "--settle", "0", "--", "true"], "--settle"),
        (["pick", "--min-free", HUGE], "--min-free"),
        (["pick", "--max-util", "nan"], "--max-util"),
        (["pick", "--max-processes", "-1"], "--max-processes"),
        (["pick", "-n", "²"], "-n/--gpus"),
        (["demo", "--epochs", "0"], "--epochs"),
        (["demo", "--batch-size", HUGE], "--batch-size"),
        (["demo", "--seed", "-1"], "--seed"),
    ],
)
def test_a_bad_number_is_a_two_line_usage_error_naming_the_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpukit {argv[0]}: error: argument {named}: ")
    assert err.endswith(f"Try 'gpukit {argv[0]} --help'.\n")
    assert len(err.splitlines()) == 2


def test_an_output_file_name_too_long_for_the_system_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="File name too long"):
        OutputFile()(str(tmp_path / ("9" * 400)))


def test_an_output_file_that_is_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    # A co-user's link in /tmp would otherwise make gpukit overwrite the file it points at.
    mine = tmp_path / "bashrc"
    mine.write_text("keep me")
    (tmp_path / "b.json").symlink_to(mine)
    with pytest.raises(argparse.ArgumentTypeError, match="is a symbolic link"):
        OutputFile()(str(tmp_path / "b.json"))
    assert mine.read_text() == "keep me"


@pytest.mark.parametrize("command", ["pick", "run"])
def test_a_min_free_without_a_unit_is_refused_with_what_was_likely_meant(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--min-free", "20", *(["--", "true"] if command == "run" else [])])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --min-free: '20' has no unit: did you mean 20GiB?" in err
    assert '"20B"' in err


def test_an_option_and_the_poll_interval_take_the_same_longest_duration() -> None:
    from gpukit.errors import InvalidArgumentError
    from gpukit.sharing.acquire import poll_interval

    assert Seconds()(str(MAX_SECONDS)) == poll_interval(MAX_SECONDS) == MAX_SECONDS
    with pytest.raises(argparse.ArgumentTypeError):
        Seconds()(str(MAX_SECONDS + 1))
    with pytest.raises(InvalidArgumentError):
        poll_interval(MAX_SECONDS + 1)
