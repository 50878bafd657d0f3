"""gk.save keeps the weights as they are (float32 master weights under mixed precision) unless an
export dtype is asked for; then only the weights change dtype, ties stay, and gk.load reads them
back into the model's own dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import gpukit as gk
from gpukit.errors import InvalidArgumentError


def _tied() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied, as language models tie embedding and head
    return model


def _dtypes(path: Path) -> dict[str, torch.dtype]:
    with safe_open(str(path), framework="pt") as f:
        return {key: f.get_tensor(key).dtype for key in f.keys()}  # noqa: SIM118


def test_weights_are_saved_in_their_own_dtype_when_no_export_dtype_is_asked(
    tmp_path: Path,
) -> None:
    path = gk.save(_tied(), tmp_path / "m.safetensors")
    assert set(_dtypes(path).values()) == {torch.float32}


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bf16", "bfloat16"])
def test_an_export_dtype_writes_the_weights_in_it_and_stores_tied_weights_once(
    tmp_path: Path, dtype: torch.dtype | str
) -> None:
    model = _tied()
    path = gk.save(model, tmp_path / "m.safetensors", dtype=dtype)
    stored = _dtypes(path)
    assert set(stored.values()) == {torch.bfloat16}
    assert len(stored) == 2  # the tied weight once, and the head's bias

    back = _tied()
    nn.init.zeros_(back[0].weight)
    report = gk.load(back, path)
    assert report.ok
    assert back[0].weight.dtype == torch.float32  # the model's own dtype
    assert back[1].weight is back[0].weight  # still tied
    expected = model[0].weight.detach().to(torch.bfloat16).float()
    assert torch.equal(back[0].weight.detach(), expected)


def test_an_export_dtype_casts_the_models_weights_and_leaves_the_optimizer_state_as_it_is(
    tmp_path: Path,
) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = gk.save({"model": model, "optimizer": opt}, tmp_path / "run.pt", dtype="fp16")
    saved = torch.load(path, weights_only=True)
    assert {t.dtype for t in saved["model"].values()} == {torch.float16}
    moments = saved["optimizer"]["state"][0]
    assert moments["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.int8, "int4", 16, "float64x"])
def test_a_dtype_that_is_no_floating_export_dtype_is_refused_before_anything_is_written(
    tmp_path: Path, dtype: object
) -> None:
    with pytest.raises(InvalidArgumentError, match="dtype="):
        gk.save(nn.Linear(2, 2), tmp_path / "m.safetensors", dtype=dtype)  # type: ignore[arg-type]
    assert not (tmp_path / "m.safetensors").exists()
