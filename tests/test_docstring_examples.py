"""The examples in the docstrings run and print what they say, on a fake 2-GPU machine."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import gpukit

SRC = Path(gpukit.__file__).resolve().parent
MODULES = sorted(
    "gpukit." + ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
    for p in SRC.rglob("*.py")
    if p.name != "__main__.py"
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_print_what_they_show(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = importlib.import_module(name)
    monkeypatch.chdir(tmp_path)  # examples that save a file save it here
    monkeypatch.setenv("GPUKIT_FAKE_NVML", "kaggle-2xT4-idle")
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(tmp_path / "locks"))
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report: list[str] = []
    for test in finder.find(module, name):
        runner.run(test, out=report.append)
    assert runner.summarize(verbose=False).failed == 0, "".join(report)
