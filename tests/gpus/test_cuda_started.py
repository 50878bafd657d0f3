"""Whether CUDA has started: one answer, given by gpukit.gpus.visible, that devices.py asks too."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import gpukit as gk
import gpukit.devices as devices
import gpukit.gpus.visible as visible
from gpukit.errors import CudaAlreadyInitializedError


def _driver(monkeypatch: pytest.MonkeyPatch, *, started: bool) -> None:
    monkeypatch.setattr(visible, "_driver_started", lambda: started)


@pytest.mark.parametrize("torch_set_up", [True, False])
def test_devices_and_visible_devices_agree_on_whether_torch_has_set_cuda_up(
    monkeypatch: pytest.MonkeyPatch, torch_set_up: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: torch_set_up)
    _driver(monkeypatch, started=torch_set_up)  # torch setting CUDA up starts the driver
    answers = {
        "devices": devices.cuda_initialized(),
        "visible": visible.cuda_started(),
        "visible, by torch": visible.cuda_started(by_torch=True),
    }
    assert answers == dict.fromkeys(answers, torch_set_up)


def test_a_driver_started_outside_torch_blocks_set_visible_devices_but_is_not_torch_set_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch.cuda.is_available() runs cuInit while torch.cuda.is_initialized() stays False:
    # CUDA_VISIBLE_DEVICES is read, yet torch.cuda.current_device() would still set CUDA up.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    _driver(monkeypatch, started=True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert visible.cuda_started() is True
    assert devices.cuda_initialized() is False
    with pytest.raises(CudaAlreadyInitializedError):
        gk.set_visible_devices([1])


def test_asking_whether_cuda_started_imports_no_torch_and_starts_nothing() -> None:
    code = (
        "import sys; from gpukit.gpus.visible import cuda_started;"
        "print(cuda_started(), cuda_started(by_torch=True), 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["False", "False", "False"]
