"""Checkpoint save/load: gk.save/gk.load against bare torch.save/torch.load, safetensors vs pickle.

Every candidate writes to and reads from the same folder, round-robin (see ``compare``), so slow
moments of the disk fall on all of them alike. gk.save pays for its atomicity (a temporary
file, an fsync of the data and of the folder); bare torch.save does neither, so the ratio is
the price of never losing a checkpoint. A sharded safetensors folder is loaded against
torch.load of the same weights as one .pt file, for time and for the growth of the process's
peak memory (measured in a fresh process, from Linux's peak-RSS counter reset just before).
"""

from __future__ import annotations

import os
import subprocess
import sys
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


_PEAK = """
import sys, torch
from torch import nn
import gpukit as gk

def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])
gk.load(nn.Linear(1, 1), sys.argv[3])  # imports and first-use allocations, before measuring
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS starts again from the current RSS
before = hwm_kib()
if sys.argv[1] == "gk":
    gk.load(model, sys.argv[2])
else:
    model.load_state_dict(torch.load(sys.argv[2], weights_only=True, map_location="cpu"))
print(hwm_kib() - before)
"""


def _peak_growth_mib(kind: str, path: Path, warm: Path) -> float:
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, kind, str(path), str(warm)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=600,
    )
    return int(done.stdout.strip()) / 1024


def _peak_memory(base: Path) -> list[BenchResult]:
    """64 MiB of weights from 8 MiB shards vs one .pt: growth of peak RSS while loading."""
    if not Path("/proc/self/clear_refs").exists():
        return []  # the peak-RSS reset is Linux's
    model = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(16)))
    folder, single, warm = base / "peak", base / "peak.pt", base / "warm.safetensors"
    save(model, folder, max_shard_size="8MiB")
    torch.save(model.state_dict(), single)
    save(nn.Linear(1, 1), warm)
    sharded = _peak_growth_mib("gk", folder, warm)
    whole = _peak_growth_mib("torch", single, warm)
    return [
        BenchResult(
            SUITE,
            "gk.load sharded folder: peak RSS growth",
            sharded,
            "MiB",
            "torch.load + load_state_dict .pt",
            whole,
            target="<= 32 MiB",
            target_value=32.0,
            note="64 MiB of float32 weights in 8 shards of 8 MiB, into an allocated model",
            extra={"bytes": _size(model), "shards": 8},
        )
    ]


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
        sharded = base / "sharded"
        shard_size = max(1 << 20, size // 8)  # 8 shards, as a Hugging Face model has a few
        saves = compare(
            {
                "gk.save .pt": lambda: save(model, pt),
                "torch.save": lambda: torch.save(state, bare),
                "torch.save + fsync": lambda: _durable_torch_save(state, bare),
                "gk.save .safetensors": lambda: save(model, st),
            },
            repeat=repeat,
        )
        save(model, sharded, max_shard_size=shard_size)
        loads = compare(
            {
                "gk.load .pt": lambda: load(model, pt),
                "torch.load + load_state_dict": lambda: model.load_state_dict(
                    torch.load(bare, weights_only=True, map_location="cpu")
                ),
                "gk.load .safetensors": lambda: load(model, st),
                "gk.load sharded folder": lambda: load(model, sharded),
            },
            repeat=repeat,
        )
        peak = _peak_memory(base)
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
            target_ratio=1.15,
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
        BenchResult(
            SUITE,
            "gk.load sharded safetensors folder",
            loads["gk.load sharded folder"],
            "s",
            "torch.load + load_state_dict",
            loads["torch.load + load_state_dict"],
            target="<= 1.0x",
            target_ratio=1.0,
            note=f"{note}, in 8 shards",
            extra={**extra, "shard_bytes": shard_size},
        ),
        *peak,
    ]
