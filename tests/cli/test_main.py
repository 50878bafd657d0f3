"""`gpukit` itself: usage errors name the command, and no path mistake ends in a traceback."""

from __future__ import annotations

import argparse

import pytest

from gpukit.cli import main as cli_main


def test_a_path_the_system_refuses_is_a_one_line_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpukit.cli import info

    def run(args: argparse.Namespace) -> int:
        raise PermissionError(13, "Permission denied", "/root/report.json")

    monkeypatch.setattr(info, "run", run)
    assert cli_main.main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpukit info: /root/report.json: Permission denied.")
    assert len(err.splitlines()) == 1


def test_an_os_error_without_a_path_is_still_an_internal_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without a path it is not the user's mistake: it goes up with its traceback, exit 1.
    from gpukit.cli import info

    def run(args: argparse.Namespace) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(info, "run", run)
    with pytest.raises(OSError, match="No space left"):
        cli_main.main(["info"])


def test_a_usage_error_names_the_command_and_points_to_its_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main.main(["pick", "--bogus"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("gpukit pick: error: unrecognized arguments: --bogus")
    assert err.endswith("Try 'gpukit pick --help'.\n")


@pytest.mark.parametrize(
    ("typo", "meant"), [("lsit", "'list'"), ("qeue", "'queue'"), ("setup-lock", "'setup-locks'")]
)
def test_a_mistyped_command_is_a_usage_error_that_names_the_closest_command(
    capsys: pytest.CaptureFixture[str], typo: str, meant: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main.main([typo, "--json"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpukit: error: unknown command '{typo}'. Did you mean {meant}?")
    assert err.endswith("Try 'gpukit --help'.\n")


def test_a_command_like_nothing_known_lists_the_commands(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main.main(["frobnicate"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Did you mean" not in err
    assert "The commands: info, list, pick," in err


def test_gpukit_alone_is_a_usage_error_with_the_help_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main.main([]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: gpukit")
    assert "exit codes:" in err
