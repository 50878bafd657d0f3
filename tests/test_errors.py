"""The error hierarchy: what callers catch and what the CLI turns into exit codes."""

from __future__ import annotations

import pytest

import gpukit as gk
from gpukit import errors
from tests.helpers import run_python


def test_every_error_is_a_gpukit_error_with_an_exit_code() -> None:
    classes = [
        obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, Exception)
    ]
    assert len(classes) > 10
    for cls in classes:
        assert issubclass(cls, errors.GpukitError)
        assert isinstance(cls.exit_code, errors.ExitCode)


def test_message_and_hint_read_as_one_sentence_pair() -> None:
    exc = errors.DeviceError("cuda:3 is not visible.", hint="Use cuda:0.")
    assert str(exc) == "cuda:3 is not visible. Use cuda:0."
    assert exc.message == "cuda:3 is not visible."
    assert exc.hint == "Use cuda:0."


def test_exit_codes_match_the_documented_contract() -> None:
    assert errors.NoDriverError("x").exit_code == 3
    assert errors.NoGpuAvailableError("x").exit_code == 4
    assert errors.WaitTimeoutError("x").exit_code == 124
    assert errors.DeviceError("x").exit_code == 2


def test_errors_are_reachable_from_the_top_level() -> None:
    assert gk.DeviceError is errors.DeviceError
    assert gk.GpukitError is errors.GpukitError


def test_importing_gpukit_does_not_import_torch() -> None:
    code = "import sys, gpukit, gpukit.errors, gpukit.cli.main; print('torch' in sys.modules)"
    out = run_python(code)
    assert out.strip() == "False"


def test_every_error_class_is_importable_from_gpukit_and_listed_in_all() -> None:
    classes = [
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, errors.GpukitError)
    ]
    for name in classes:
        assert name in gk.__all__, name
        assert getattr(gk, name) is getattr(errors, name)


def test_every_error_the_docs_name_is_importable_from_gpukit() -> None:
    import builtins
    import re

    from tests.helpers import ROOT

    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {m for path in texts for m in re.findall(r"\b([A-Z]\w*Error)\b", path.read_text())}
    ours = {name for name in named if not hasattr(builtins, name)}
    foreign = {"ChildFailedError", "NVMLError", "OutOfMemoryError", "PicklingError"}
    missing = sorted(name for name in ours - foreign if not hasattr(gk, name))
    assert missing == []
    assert "WorkerFailedError" in ours
    from gpukit import GatherError, ReplicaError, VisibleDevicesError, WorkerFailedError

    assert GatherError.__module__ == ReplicaError.__module__ == "gpukit.errors"
    assert VisibleDevicesError.__module__ == WorkerFailedError.__module__ == "gpukit.errors"


@pytest.mark.parametrize("value", ["no", "false", 0, 1, None, "True"])
def test_switches_refuse_values_that_are_only_truthy(value: object) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="is not True or False") as caught:
        errors.check_bool("trust", value)
    assert f"trust={value!r}" in caught.value.message
    assert caught.value.hint is not None


def test_switches_take_true_false_and_where_allowed_none() -> None:
    errors.check_bool("trust", True)
    errors.check_bool("trust", False)
    errors.check_bool("benchmark", None, allow_none=True)
