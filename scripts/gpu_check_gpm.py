"""Tensor core activity from GPM on a real GPU: what gpukit serve's DCGM_FI_PROF_PIPE_TENSOR_ACTIVE
reads, checked while a bf16 matmul loop keeps the tensor cores busy in this process.

    python scripts/gpu_check_gpm.py [--gpu 0] [--seconds 1.0]

Prints GPM support, two samples ``--seconds`` apart during the loop and the ratio between them,
the same through gpukit's TensorActivity, the ``DCGM_FI_PROF_PIPE_TENSOR_ACTIVE`` lines of one
rendering of ``/metrics``, a reading with the GPU idle, and ``nvidia-smi dmon --gpm-metrics 5``
for comparison. Every step is time-boxed and says what failed; exit 0 when every check passed,
1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

DEADLINE_S = 240
"""The whole check, at most: a hung driver call must not hold the machine."""

failures: list[str] = []
_step = "start"


def _timed_out(signum: int, frame: FrameType | None) -> None:
    print(f"FAIL: the whole check ran past {DEADLINE_S} s (in step: {_step})", flush=True)
    os._exit(1)


def step(name: str, run: Callable[[], Any]) -> Any:
    """Run one step, print what it gave or how it failed; None when it failed."""
    global _step
    _step = name
    print(f"--- {name}", flush=True)
    try:
        return run()
    except Exception as exc:
        failures.append(f"{name}: {type(exc).__name__}: {exc}")
        print(f"FAIL: {name}: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(limit=4)
        return None


def check(ok: bool, what: str) -> None:
    print(("ok:   " if ok else "FAIL: ") + what, flush=True)
    if not ok:
        failures.append(what)


@contextmanager
def matmul_loop(gpu: int) -> Iterator[threading.Event]:
    """bf16 matmuls on ``cuda:gpu`` in a background thread until the block ends."""
    import torch

    device = torch.device("cuda", gpu)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    stop, running = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            with torch.cuda.device(device):
                while not stop.is_set():
                    for _ in range(8):
                        torch.mm(a, b)
                    torch.cuda.synchronize(device)  # a bounded queue: stop ends it quickly
                    running.set()
        except BaseException as exc:  # reported below, after the block
            errors.append(exc)
            running.set()

    thread = threading.Thread(target=loop, name="matmul", daemon=True)
    thread.start()
    if not running.wait(timeout=60):
        raise TimeoutError("the matmul loop did not start within 60 s")
    time.sleep(0.5)  # past the clocks' ramp-up
    try:
        yield stop
    finally:
        stop.set()
        thread.join(timeout=30)
        if errors:
            raise RuntimeError(f"the matmul loop failed: {errors[0]!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", type=int, default=0, help="NVML index (= CUDA index here)")
    parser.add_argument("--seconds", type=float, default=1.0, help="between the two samples")
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(DEADLINE_S)

    from gpukit.gpus.gpm import TensorActivity, take_sample, tensor_ratio
    from gpukit.gpus.inventory import _Reader, _session, inventory

    nvml, source = step("NVML", _session) or (None, None)
    if nvml is None:
        return 1
    read = _Reader(nvml)
    inv = step("inventory", inventory)
    if inv is None:
        return 1
    for g in inv.gpus:
        print(f"GPU {g.index}: {g.name}, {g.uuid}, cc {g.compute_capability}, MIG {g.mig_mode}")
    print(f"driver {inv.driver_version}, source {source}, pynvml {nvml.__file__}")
    handle = nvml.nvmlDeviceGetHandleByIndex(args.gpu)
    support = step("GPM support", lambda: nvml.nvmlGpmQueryDeviceSupport(handle))
    supported = bool(support is not None and support.isSupportedDevice)
    print(f"nvmlGpmQueryDeviceSupport: isSupportedDevice={supported}")
    check(supported, f"GPU {args.gpu} supports GPM")
    if not supported:
        return 1

    def raw_samples() -> float | None:
        with matmul_loop(args.gpu):
            first = take_sample(read, handle)
            time.sleep(args.seconds)
            second = take_sample(read, handle)
        if first is None or second is None:
            raise RuntimeError(f"a sample could not be taken: {first!r}, {second!r}")
        try:
            print(f"sample 1: {first.raw} at {first.taken_at:.3f}")
            print(f"sample 2: {second.raw} at {second.taken_at:.3f}")
            return tensor_ratio(read, first, second)
        finally:
            first.free()
            second.free()

    busy = step("two samples during the matmul loop", raw_samples)
    print(f"tensor activity, busy: {busy}")
    check(busy is not None and 0.05 < busy <= 1.0, f"busy tensor activity in (0.05, 1]: {busy}")

    uuid = inv.gpus[args.gpu].uuid

    def through_tensor_activity() -> float | None:
        activity = TensorActivity()
        try:
            with matmul_loop(args.gpu):
                first = activity.read(inventory())
                time.sleep(args.seconds)
                second = activity.read(inventory())
        finally:
            activity.close()
        print(f"TensorActivity: first reading {first}, second {second}")
        check(first == {}, "the first reading has no value")
        return second.get(uuid)

    via_class = step("TensorActivity during the matmul loop", through_tensor_activity)
    check(via_class is not None and via_class > 0.05, f"TensorActivity busy value: {via_class}")

    def metrics_lines() -> list[str]:
        from gpukit.serve.sampler import Sampler

        sampler = Sampler(3600)
        try:
            with matmul_loop(args.gpu):
                sampler.sample()
                time.sleep(args.seconds)
                sample = sampler.sample()
        finally:
            sampler.stop()
        print(f"failed parts: {sample.failed or 'none'}")
        lines = [
            line
            for line in sample.metrics.decode().splitlines()
            if "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" in line
        ]
        print("\n".join(lines))
        return lines

    lines = step("/metrics rendering", metrics_lines) or []
    check(
        any(line.startswith("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{") for line in lines),
        "/metrics has a DCGM_FI_PROF_PIPE_TENSOR_ACTIVE sample",
    )

    def idle() -> float | None:
        time.sleep(1.0)  # the loop's last kernels drained
        first = take_sample(read, handle)
        time.sleep(args.seconds)
        second = take_sample(read, handle)
        if first is None or second is None:
            raise RuntimeError("a sample could not be taken")
        try:
            return tensor_ratio(read, first, second)
        finally:
            first.free()
            second.free()

    quiet = step("two samples with the GPU idle (in this process)", idle)
    print(f"tensor activity, idle: {quiet}")
    check(
        quiet is not None and busy is not None and quiet < busy,
        f"idle below busy: {quiet} < {busy}",
    )

    def dmon() -> None:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            print("no nvidia-smi on PATH")
            return
        with matmul_loop(args.gpu):
            done = subprocess.run(
                [smi, "dmon", "-i", str(args.gpu), "--gpm-metrics", "5", "-c", "3"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        print(f"nvidia-smi dmon --gpm-metrics 5 (exit {done.returncode}, during the loop):")
        print((done.stdout + done.stderr).strip()[-2000:])

    step("nvidia-smi dmon, for comparison (not checked)", dmon)
    signal.alarm(0)
    print("--- summary")
    for failure in failures:
        print(f"FAIL: {failure}")
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
