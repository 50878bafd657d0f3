"""Random argument lists for every command: never a traceback, always a documented exit code.

Each list mixes the command's own options with values a careless or hostile user types (nan,
inf, 400 digits, non-ASCII digits, folders where files belong, missing folders). ``gpukit list``,
``pick`` and ``run`` run for real on a fake machine (``run`` without starting its command or
waiting); the commands that would train, measure or read checkpoints run only up to their
parser, where all their options are checked.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpukit.cli import main as cli_main
from gpukit.errors import ExitCode, WaitTimeoutError
from gpukit.untrusted import MAX_SECONDS

# Every code the README documents, except 1: an internal failure is never a user's doing.
DOCUMENTED = {int(code) for code in ExitCode} - {int(ExitCode.INTERNAL)}

HUGE = "9" * 400
NUMBERS = ["nan", "inf", "-inf", "-1", "0", "1", "2", "3.5", "1e400", HUGE, "²", "٣"]
WORDS = [
    *("", " ", "-", "--", "x", "20GiB", "lots", "true", "cpu,cpu", "cuda:99", "gpu", "transfer"),
    *("{tmp}/folder.pt", "{tmp}/missing/dir/b.json", "{tmp}/out.json", "{tmp}/out.png"),
    *("{tmp}/file.txt/x.json", "{tmp}/m.safetensors", "free"),
]


def _tokens(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string and sub-command name that ``parser`` knows, nested ones included."""
    found: list[str] = []
    for action in parser._actions:
        found += list(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [name, *_tokens(sub)]
    return found


def _command_parser(command: str) -> argparse.ArgumentParser:
    return cli_main._subparser(cli_main.build_parser(command), command)


def _argv(command: str) -> st.SearchStrategy[list[str]]:
    option = st.sampled_from(sorted(set(_tokens(_command_parser(command)))))
    value = st.sampled_from(NUMBERS) | st.sampled_from(WORDS) | st.text(max_size=6)
    # Mostly an option with a value after it, as people write them, often a number; sometimes
    # an option or a value alone.
    pair = st.tuples(option, st.sampled_from(NUMBERS) | value).map(list)
    chunk = st.one_of(pair, pair, pair, option.map(lambda o: [o]), value.map(lambda v: [v]))
    return st.lists(chunk, max_size=5).map(lambda chunks: [a for c in chunks for a in c])


def _as_sleep_would(seconds: float) -> None:
    """Fail as time.sleep does for nan, inf or a negative time, or for one that never ends."""
    if not 0 <= seconds <= MAX_SECONDS:
        raise ValueError(f"time.sleep({seconds}) fails or never ends")


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A 2-GPU fake machine, a private lock folder, and commands that start nothing."""
    from gpukit.cli import demo, info, list_gpus
    from gpukit.cli import run as run_cmd

    monkeypatch.setenv("GPUKIT_FAKE_NVML", "kaggle-2xT4-idle")
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.delenv("GPUKIT_POLL_INTERVAL", raising=False)
    (tmp_path / "folder.pt").mkdir()
    (tmp_path / "file.txt").write_text("")

    def stop_watching(seconds: float) -> None:
        _as_sleep_would(seconds)
        raise KeyboardInterrupt  # Ctrl-C after the first reading

    monkeypatch.setattr(
        list_gpus,
        "time",
        SimpleNamespace(sleep=stop_watching, strftime=time.strftime, localtime=time.localtime),
    )
    monkeypatch.setattr(run_cmd, "supervise", lambda argv, env, **_: 0)

    def no_wait(*args: Any, poll: float, timeout: float | None, **kwargs: Any) -> Any:
        _as_sleep_would(poll)
        _as_sleep_would(0.0 if timeout is None else timeout)
        raise WaitTimeoutError("waited in a test", hint="none")

    import gpukit.sharing.acquire as acquire

    monkeypatch.setattr(acquire, "wait_and_claim", no_wait)
    # list --hosts checks its hosts, timeout and ssh command for real, then reaches no one.
    import gpukit.gpus.hosts as hosts

    def unreached(host: str, ssh: Any, timeout: float) -> Any:
        _as_sleep_would(timeout)
        return hosts.HostReading(host, error="not reached in a test")

    monkeypatch.setattr(hosts, "read_host", unreached)
    # Past their parsers, these train, measure, read files, watch forever or set up the
    # machine's own lock folder: their options are checked above.
    import gpukit.cli.bench as bench
    import gpukit.cli.ckpt as ckpt
    import gpukit.cli.queue as queue
    import gpukit.cli.serve as serve
    import gpukit.cli.setup_locks as setup_locks

    # serve would listen until stopped.
    for module in (info, demo, bench, ckpt, queue, serve, setup_locks):
        monkeypatch.setattr(module, "run", lambda args: 0)
    return tmp_path


@pytest.mark.parametrize("command", sorted(cli_main.COMMANDS))
def test_random_arguments_never_give_a_traceback_or_an_undocumented_code(
    machine: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    @settings(
        max_examples=200,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(_argv(command))
    def check(argv: list[str]) -> None:
        argv = [a.replace("{tmp}", str(machine)) for a in argv]
        capsys.readouterr()
        try:
            code = cli_main.main([command, *argv])
        except SystemExit as exc:  # argparse: --help, or a usage error
            code = exc.code if isinstance(exc.code, int) else 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert code in DOCUMENTED, (argv, code, err)

    check()


def test_the_fuzz_reaches_every_option_of_every_command() -> None:
    # A command whose options the strategy could not see would be fuzzed with values alone.
    for command in cli_main.COMMANDS:
        tokens = _tokens(_command_parser(command))
        assert "-h" in tokens
    assert {"--watch", "--json", "--hosts", "--timeout", "--ssh-command"} <= set(
        _tokens(_command_parser("list"))
    )
    assert {"--host", "--port", "--interval"} <= set(_tokens(_command_parser("serve")))
    assert {"--poll", "--timeout", "--settle", "-n", "--min-free"} <= set(
        _tokens(_command_parser("run"))
    )
    assert {"show", "convert", "--weights-only"} <= set(_tokens(_command_parser("ckpt")))
