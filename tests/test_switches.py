"""Every boolean switch of the public API takes True or False, never a merely truthy value."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.errors import InvalidArgumentError


def _load_trust(tmp_path: Path, value: object) -> Any:
    path = tmp_path / "m.pt"
    torch.save({"weight": torch.zeros(1, 1), "bias": torch.zeros(1)}, path)
    return gk.load(nn.Linear(1, 1), path, trust=value)  # type: ignore[arg-type]


CALLS: dict[str, Callable[[Path, object], Any]] = {
    "trust": _load_trust,
    "strict": lambda tmp, v: gk.load(nn.Linear(1, 1), tmp / "absent.pt", strict=v),  # type: ignore[arg-type]
    "pin": lambda tmp, v: gk.to_device(torch.ones(1), "cpu", pin=v),  # type: ignore[arg-type]
    "non_blocking": lambda tmp, v: gk.to_device(torch.ones(1), "cpu", non_blocking=v),  # type: ignore[arg-type]
    "deterministic": lambda tmp, v: gk.seed_everything(0, deterministic=v),  # type: ignore[arg-type]
    "benchmark": lambda tmp, v: gk.seed_everything(0, benchmark=v),  # type: ignore[arg-type]
    "cuda_details": lambda tmp, v: gk.system_info(cuda_details=v),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("switch", sorted(CALLS))
@pytest.mark.parametrize("value", ["no", "false", 1, 0])
def test_a_switch_refuses_a_value_that_is_not_a_bool(
    tmp_path: Path, switch: str, value: object
) -> None:
    with pytest.raises(InvalidArgumentError, match=f"{switch}={value!r}"):
        CALLS[switch](tmp_path, value)


def test_load_with_trust_no_does_not_run_the_pickles_code(tmp_path: Path) -> None:
    # "no" is a non-empty string, so it was read as trust=True and the pickle ran.
    with pytest.raises(InvalidArgumentError, match="trust='no'"):
        _load_trust(tmp_path, "no")
    assert _load_trust(tmp_path, False).loaded
