"""Start-up time of ``gpukit list`` and ``gpukit queue`` against ``import torch``, nvitop, gpustat.

Every command runs as a fresh subprocess of this Python, round-robin, so each pays the same
interpreter start and the same noise. On a machine without an NVIDIA driver gpukit, nvitop and
gpustat all take their "no driver" path and fail; their start-up is still what a user waits for.
A fake 8-GPU machine (GPUKIT_FAKE_NVML) adds the cost of reading and rendering GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpukit.bench.core import BenchResult, compare

SUITE = "startup"
_TORCH = "python -c 'import torch'"


def _fake_machine(folder: Path, n_gpus: int = 8) -> Path:
    """A busy 8-GPU server description, so the fake run reads and renders real-sized data."""
    gpus = [
        {
            "index": i,
            "uuid": f"GPU-{i:08x}-0000-0000-0000-000000000000",
            "name": "NVIDIA A100-SXM4-80GB",
            "pci_bus_id": f"00000000:{16 * i + 7:02X}:00.0",
            "memory_total": 85899345920,
            "memory_used": 40 * 2**30,
            "memory_reserved": 2**29,
            "utilization_gpu": 50,
            "utilization_memory": 20,
            "temperature_c": 50,
            "power_usage_mw": 200000,
            "power_limit_mw": 400000,
            "compute_capability": [8, 0],
            "mig_mode": False,
            "processes": [
                {
                    "pid": 1000 + i,
                    "user": "user",
                    "name": "python train.py",
                    "used_memory": 39 * 2**30,
                }
            ],
        }
        for i in range(n_gpus)
    ]
    path = folder / "server.json"
    path.write_text(
        json.dumps({"driver_version": "550.54.15", "cuda_driver_version": 12040, "gpus": gpus})
    )
    return path


def _command(args: list[str], env: dict[str, str]) -> Callable[[], int]:
    def run() -> int:
        return subprocess.run(
            args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False
        ).returncode

    return run


def _available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run(quick: bool = False) -> list[BenchResult]:
    """Median start-up seconds of each command; ratios of gpukit's against each alternative."""
    py = sys.executable
    src = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
    }
    env.pop("GPUKIT_FAKE_NVML", None)
    with tempfile.TemporaryDirectory() as tmp:
        fake_env = {**env, "GPUKIT_FAKE_NVML": str(_fake_machine(Path(tmp)))}
        # gpukit queue reads claims, the line and the ledger: give it a lock folder of its own.
        queue_env = {**fake_env, "GPUKIT_LOCK_DIR": str(Path(tmp) / "locks")}
        candidates: dict[str, Callable[[], object]] = {
            "gpukit list --json (this machine)": _command(
                [py, "-m", "gpukit", "list", "--json"], env
            ),
            "gpukit list --json (fake 8-GPU machine)": _command(
                [py, "-m", "gpukit", "list", "--json"], fake_env
            ),
            "gpukit list (fake 8-GPU machine, table)": _command(
                [py, "-m", "gpukit", "list"], fake_env
            ),
            "gpukit queue --json (fake 8-GPU machine)": _command(
                [py, "-m", "gpukit", "queue", "--json"], queue_env
            ),
            "python -c pass": _command([py, "-c", "pass"], env),
            _TORCH: _command([py, "-c", "import torch"], env),
        }
        missing = []
        for tool, args in (("nvitop", ["-1"]), ("gpustat", [])):
            if _available(tool):
                candidates[" ".join([tool, *args])] = _command([py, "-m", tool, *args], env)
            else:
                missing.append(tool)
        exit_codes = {name: fn() for name, fn in candidates.items()}
        times = compare(candidates, repeat=1 if quick else 11, warmup=0 if quick else 1)
    results = _results(times, exit_codes)
    if missing:
        note = (
            f"{' and '.join(missing)} not installed, so not measured (pip install 'gpukit[bench]')"
        )
        results = [
            dataclasses.replace(r, note=f"{r.note}; {note}" if r.note else note) for r in results
        ]
    return results


def _results(times: dict[str, float], exit_codes: dict[str, object]) -> list[BenchResult]:
    extra: dict[str, Any] = {"seconds": times, "exit_codes": exit_codes}
    baselines = {_TORCH: ("< 0.15", 0.15), "nvitop -1": ("<= 1", 1.0), "gpustat": ("<= 1", 1.0)}
    results = []
    for name in [n for n in times if n.startswith("gpukit")]:
        for base, usual in baselines.items():
            # gpukit queue also reads the claims, the line and the ledger.
            queue = base == _TORCH and name.startswith("gpukit queue")
            target, goal = ("< 0.2", 0.2) if queue else usual
            if base in times:
                results.append(
                    BenchResult(
                        suite=SUITE,
                        name=name,
                        value=times[name],
                        unit="s",
                        baseline_name=base,
                        baseline_value=times[base],
                        target=target,
                        target_ratio=goal,
                        note=f"exit codes {exit_codes[name]} vs {exit_codes[base]}",
                        extra=extra,
                    )
                )
    return results
