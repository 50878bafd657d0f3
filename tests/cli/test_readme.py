"""The README's command line section keeps step with what `gpukit COMMAND --help` shows."""

from __future__ import annotations

import argparse
import re

import pytest

from gpukit.cli.main import COMMANDS, _subparser, build_parser
from tests.helpers import ROOT


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """The long options of ``parser`` and of its sub-commands, as --help lists them."""
    found: set[str] = set()
    for action in parser._actions:
        found |= {s for s in action.option_strings if s.startswith("--") and s != "--help"}
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_readme_names_every_option_of_the_command(command: str) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The command line") : readme.index("### Exit codes")]
    parser = _subparser(build_parser(command), command)
    missing = sorted(
        option
        for option in _options(parser)
        if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", section)
    )
    assert f"`gpukit {command}" in section
    assert missing == []
