"""Entry point of the ``gpukit`` command.

Only the module of the command being run is imported, so ``gpukit list`` and ``gpukit pick``
never pay for torch. Each command module defines ``configure(parser)`` to add its arguments
and ``run(args) -> int`` to do the work.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType

from gpukit.errors import ExitCode, GpukitError

# name -> (module, one-line help). Order is the order of `gpukit --help`.
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("gpukit.cli.info", "everything torch and the driver know about this machine"),
    "list": ("gpukit.cli.list_gpus", "one line per GPU with its memory, load and users"),
    "pick": ("gpukit.cli.pick", "print the indices of free GPUs that meet the criteria"),
    "run": ("gpukit.cli.run", "pick, claim and wait for GPUs, then run a command on them"),
    "queue": ("gpukit.cli.queue", "who holds which GPU, who waits and why, unclaimed and idle use"),
    "usage": ("gpukit.cli.usage", "GPU-hours, runs and longest run per user, from the ledger"),
    "serve": ("gpukit.cli.serve", "serve the GPUs as Prometheus metrics and a live web page"),
    "ckpt": ("gpukit.cli.ckpt", "inspect and repair checkpoints"),
    "demo": ("gpukit.cli.demo", "train a small network on bundled digits over every device"),
    "bench": ("gpukit.cli.bench", "measure this machine and gpukit against the alternatives"),
    "setup-locks": ("gpukit.cli.setup_locks", "(admin) give the machine a lock folder root owns"),
}

EPILOG = """exit codes:
  0    success
  1    internal failure (a bug: please report it with the traceback)
  2    usage error (bad arguments, unknown device)
  3    no NVIDIA driver or NVML on this machine
  4    no GPU satisfies the criteria
  5    the lock folder cannot be created or written, or is refused as unsafe
  124  waited past --timeout
  gpukit run otherwise returns the exit code of the command it ran.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors on exit code 2 and a pointer to --help."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message}\nTry '{self.prog} --help'.\n")


def _command_module(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name][0])


def build_parser(selected: str | None) -> argparse.ArgumentParser:
    """The parser for ``gpukit``; only ``selected``'s own arguments are loaded."""
    from gpukit import __version__

    parser = _Parser(
        prog="gpukit",
        description="The practical GPU layer for PyTorch.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpukit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (_, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            _command_module(name).configure(command)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    return parser


def _selected(argv: Sequence[str]) -> str | None:
    for arg in argv:
        if arg in COMMANDS:
            return arg
        if not arg.startswith("-"):
            return None
    return None


def _check_command(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Refuse an unknown command with the closest known ones, before argparse lists them all."""
    import difflib

    word = next((arg for arg in argv if not arg.startswith("-")), None)
    if word is None or word in COMMANDS:
        return
    close = difflib.get_close_matches(word, COMMANDS, n=2, cutoff=0.6)
    guess = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    parser.error(f"unknown command {word[:40]!r}.{guess} The commands: {', '.join(COMMANDS)}.")


def _warning_line(command: str) -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints ``gpukit COMMAND: warning: MESSAGE``, no source."""

    def show(message: Warning | str, *_args: object, **_kwargs: object) -> None:
        print(f"gpukit {command}: warning: {message}", file=sys.stderr)

    return show


def _os_error(exc: OSError) -> str:
    where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
    return (
        f"{where}: {exc.strerror or exc}. Check the path, that its folder exists and that you "
        "may read or write it."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gpukit`` with ``argv`` (default: the process arguments) and return the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    selected = _selected(args_list)
    parser = build_parser(selected)
    if not args_list:
        # No command is a usage error, as for git: a script calling bare gpukit learns so.
        parser.print_help(sys.stderr)
        return ExitCode.USAGE
    _check_command(parser, args_list)
    args, extra = parser.parse_known_args(args_list)
    if extra:  # said by the command's own parser, so that the message names the command
        command_parser = _subparser(parser, args.command) if args.command else parser
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return ExitCode.USAGE
    try:
        with warnings.catch_warnings():  # the library's warnings, as one line of this command's
            warnings.showwarning = _warning_line(args.command)
            return int(_command_module(args.command).run(args))
    except GpukitError as exc:
        print(f"gpukit {args.command}: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        print(f"gpukit {args.command}: interrupted.", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gpukit list | head`: the reader left; not our failure
        return ExitCode.OK
    except OSError as exc:
        if exc.filename is None:
            raise
        # A file or folder the user named that the system refused (a last resort: commands
        # check their paths before working, so this is rare): a usage error, not a traceback.
        print(f"gpukit {args.command}: {_os_error(exc)}", file=sys.stderr)
        return ExitCode.USAGE
