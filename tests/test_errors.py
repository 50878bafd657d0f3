"""The error hierarchy: what callers catch and what the CLI turns into exit codes."""

from __future__ import annotations

import gpukit as gk
from gpukit import errors
from tests.conftest import run_python


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
