"""Checkpoint save/load: gk.save/gk.load against bare torch.save/torch.load, safetensors vs pickle.

Every candidate writes to and reads from the same folder, round-robin (see ``compare``), so slow
moments of the disk fall on all of them alike. gk.save pays for its atomicity (a temporary
file, an fsync of the data and of the folder); bare torch.save does neither, so the ratio is
the price of never losing a checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from gpukit.bench.core import BenchResult, compare
from gpukit.checkpoint.api import load, save

SUITE = "checkpoint"
_WIDTH = 2048  # one Linear(2048, 2048) holds 16 MiB of float32 weights


def _model(total_bytes: int) -> nn.Module:
    layers = max(1, round(total_bytes / (_WIDTH * _WIDTH * 4)))
    return nn.Sequential(*(nn.Linear(_WIDTH, _WIDTH) for _ in range(layers)))


def _size(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _durable_torch_save(state: dict[str, torch.Tensor], path: Path) -> None:
    """torch.save made durable by hand: what gk.save's fsync costs without its other steps."""
    with path.open("wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


def run(quick: bool = False) -> list[BenchResult]:
    """Time save and load of a ~1 GiB state dict (~50 MiB in quick mode)."""
    model = _model(50 * 2**20 if quick else 2**30)
    state = model.state_dict()
    size = _size(model)
    repeat = 5 if quick else 3
    note = f"{size / 2**20:.0f} MiB state dict of float32 Linear layers"
    with tempfile.TemporaryDirectory(prefix="gpukit-bench-") as folder:
        base = Path(folder)
        pt, st, bare = base / "gk.pt", base / "gk.safetensors", base / "bare.pt"
        saves = compare(
            {
                "gk.save .pt": lambda: save(model, pt),
                "torch.save": lambda: torch.save(state, bare),
                "torch.save + fsync": lambda: _durable_torch_save(state, bare),
                "gk.save .safetensors": lambda: save(model, st),
            },
            repeat=repeat,
        )
        loads = compare(
            {
                "gk.load .pt": lambda: load(model, pt),
                "torch.load + load_state_dict": lambda: model.load_state_dict(
                    torch.load(bare, weights_only=True, map_location="cpu")
                ),
                "gk.load .safetensors": lambda: load(model, st),
            },
            repeat=repeat,
        )
    extra = {"bytes": size, "quick": quick}
    return [
        BenchResult(
            SUITE,
            "gk.save .pt (atomic, fsynced)",
            saves["gk.save .pt"],
            "s",
            "torch.save",
            saves["torch.save"],
            target="<= 1.15x",
            note=note,
            extra=extra,
        ),
        BenchResult(
            SUITE,
            "gk.save .pt (atomic, fsynced)",
            saves["gk.save .pt"],
            "s",
            "torch.save + fsync",
            saves["torch.save + fsync"],
            note=note,
            extra=extra,
        ),
        BenchResult(
            SUITE,
            "gk.save .safetensors",
            saves["gk.save .safetensors"],
            "s",
            "gk.save .pt",
            saves["gk.save .pt"],
            note=note,
            extra=extra,
        ),
        BenchResult(
            SUITE,
            "gk.load .pt",
            loads["gk.load .pt"],
            "s",
            "torch.load + load_state_dict",
            loads["torch.load + load_state_dict"],
            note=note,
            extra=extra,
        ),
        BenchResult(
            SUITE,
            "gk.load .safetensors",
            loads["gk.load .safetensors"],
            "s",
            "gk.load .pt",
            loads["gk.load .pt"],
            note=note,
            extra=extra,
        ),
    ]
