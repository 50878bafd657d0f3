"""How busy each GPU's tensor cores are, from NVML's GPU Performance Monitoring (GPM).

GPM counts what a GPU's SMs did between two *samples* of it. :class:`TensorActivity` keeps the
last sample of each GPU (by UUID) and, at each reading, takes a new one and asks NVML for
``NVML_GPM_METRIC_ANY_TENSOR_UTIL`` between the two: the share of the time any tensor pipe was
active, 0..1. DCGM serves the same number, divided by 100 the same way, as
``DCGM_FI_PROF_PIPE_TENSOR_ACTIVE`` on these GPUs; ``nvidia-smi dmon --gpm-metrics 5`` shows it
in percent.

>>> import gpukit as gk
>>> activity = TensorActivity()
>>> activity.read(gk.inventory())     # a first reading of a GPU has nothing to compare with
{}
>>> activity.read(gk.inventory())     # a second one, on an H100        # doctest: +SKIP
{'GPU-923a7369-94e3-bf91-1a61-dbe22e44158b': 0.0625}
>>> activity.close()                  # frees the samples kept

Warning:
    NVML offers GPM on Hopper and newer GPUs only (H100, H200, GH200, Blackwell). An A100,
    an L4 or L40 (Ada), a T4 or a GeForce card has no such reading: it is absent, never 0, as it
    is where the driver predates GPM. gpukit samples whole GPUs: a MIG instance gets no reading
    of its own (NVML samples those with ``nvmlGpmMigSampleGet``, which gpukit does not call).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpukit.gpus.inventory import _Reader, _session

if TYPE_CHECKING:
    from gpukit.gpus.inventory import Inventory

MIN_INTERVAL_S = 0.1
"""The shortest time between two samples of a GPU that NVML compares: its GPM counters refresh
about every 100 ms, so two samples closer than that can hold the same counts."""


@dataclass
class GpmSample:
    """One GPM sample of one GPU, a buffer NVML allocated: :meth:`free` hands it back.

    Args:
        nvml: the NVML module (or fake) that allocated it, and so frees it.
        raw: NVML's ``nvmlGpmSample_t``.
        taken_at: when it was taken, in ``time.monotonic()`` seconds.
    """

    nvml: Any
    raw: Any
    taken_at: float

    def free(self) -> None:
        """Hand the buffer back to NVML; a second call does nothing."""
        raw, self.raw = self.raw, None
        if raw is not None:
            # Freeing happens on the way out of a failed reading too: its error is the one to
            # report, and a buffer NVML refuses to free is one it no longer holds.
            with contextlib.suppress(self.nvml.NVMLError):
                self.nvml.nvmlGpmSampleFree(raw)


def take_sample(read: _Reader, handle: Any) -> GpmSample | None:
    """A new GPM sample of the GPU behind ``handle``; None where it has no GPM.

    Args:
        read: NVML, wrapped so that "this device cannot" answers None.
        handle: the GPU's NVML handle.

    Raises:
        NvmlError: NVML failed in a way other than "not supported here".
    """
    nvml = read.nvml
    support = read(nvml.nvmlGpmQueryDeviceSupport, handle)
    if support is None or not support.isSupportedDevice:
        return None
    raw = read(nvml.nvmlGpmSampleAlloc)
    if raw is None:
        return None
    sample = GpmSample(nvml, raw, time.monotonic())
    try:
        taken = read(nvml.nvmlGpmSampleGet, handle, raw)
    except BaseException:
        sample.free()
        raise
    if taken is None:
        sample.free()
        return None
    return sample


def tensor_ratio(read: _Reader, earlier: GpmSample, later: GpmSample) -> float | None:
    """The share of the time between two samples of one GPU that any tensor pipe was active,
    0..1 (NVML's percent / 100); None where NVML gives no value.

    Args:
        read: NVML, wrapped as for :func:`take_sample`.
        earlier: the first sample.
        later: a sample of the same GPU taken after it.

    Raises:
        NvmlError: NVML failed in a way other than "not supported here".
    """
    nvml = read.nvml
    request = nvml.c_nvmlGpmMetricsGet_t()
    request.version = nvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = 1
    request.sample1 = earlier.raw
    request.sample2 = later.raw
    request.metrics[0].metricId = nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
    if read(nvml.nvmlGpmMetricsGet, request) is None:
        return None
    metric = request.metrics[0]
    if metric.nvmlReturn != nvml.NVML_SUCCESS or not math.isfinite(metric.value):
        return None
    # Counters read a few cycles apart can put the percent a hair outside 0..100.
    return min(max(float(metric.value) / 100.0, 0.0), 1.0)


def tensor_active(
    read: _Reader, handle: Any, previous: GpmSample | None
) -> tuple[float | None, GpmSample | None]:
    """Take a GPM sample of a GPU: its tensor activity since ``previous``, and the sample to
    give as ``previous`` next time.

    The ratio is None where the GPU has no GPM, and where there is no ``previous`` (a first
    reading). ``previous`` is freed here unless it is the one returned (a reading within
    :data:`MIN_INTERVAL_S` of it keeps it, without a value).

    Args:
        read: NVML, wrapped as for :func:`take_sample`.
        handle: the GPU's NVML handle.
        previous: the sample this function returned for the same GPU last time, or None.

    Raises:
        NvmlError: NVML failed in a way other than "not supported here"; ``previous`` and the
            new sample are freed.
    """
    if previous is not None and time.monotonic() - previous.taken_at < MIN_INTERVAL_S:
        return None, previous
    try:
        sample = take_sample(read, handle)
        if sample is None or previous is None:
            return None, sample
        try:
            ratio = tensor_ratio(read, previous, sample)
        except BaseException:
            sample.free()
            raise
        return ratio, sample
    finally:
        if previous is not None:
            previous.free()


class TensorActivity:
    """Each GPU's tensor activity between one reading and the next, from GPM.

    Keeps one GPM sample per GPU between readings (NVML's buffers, freed when a GPU leaves the
    readings and by :meth:`close`). Safe to call from several threads.

    Args:
        nvml: the NVML module to read; None: the one :func:`gpukit.inventory` reads
            (``GPUKIT_FAKE_NVML``'s machine when that is set).
    """

    def __init__(self, nvml: Any = None) -> None:
        self._nvml = nvml
        self._kept: dict[str, GpmSample] = {}
        self._lock = threading.Lock()

    def read(self, inv: Inventory) -> dict[str, float]:
        """UUID -> share of the time since the last reading that any tensor pipe was active,
        0..1, for each GPU of ``inv`` that has GPM and was in the last reading too.

        Args:
            inv: the GPUs to read, as :func:`gpukit.inventory` just read them.

        Raises:
            NoDriverError: no NVIDIA driver (only where ``nvml`` was not given).
            NvmlError: NVML failed in a way other than "not supported here"; every sample
                kept is then freed, and the next reading starts afresh.
        """
        with self._lock:
            nvml = self._nvml if self._nvml is not None else _session()[0]
            read = _Reader(nvml)
            kept: dict[str, GpmSample] = {}
            ratios: dict[str, float] = {}
            try:
                for gpu in inv.gpus:
                    if not gpu.uuid or gpu.error is not None:
                        continue
                    previous = self._kept.pop(gpu.uuid, None)
                    handle = read(nvml.nvmlDeviceGetHandleByIndex, gpu.index)
                    if handle is None:
                        if previous is not None:
                            previous.free()
                        continue
                    ratio, sample = tensor_active(read, handle, previous)
                    if sample is not None:
                        kept[gpu.uuid] = sample
                    if ratio is not None:
                        ratios[gpu.uuid] = ratio
            except BaseException:
                for sample in kept.values():
                    sample.free()
                kept = {}
                raise
            finally:
                for gone in self._kept.values():  # GPUs no longer read (or not reached)
                    gone.free()
                self._kept = kept
            return ratios

    def close(self) -> None:
        """Free every sample kept; the next :meth:`read` starts afresh."""
        with self._lock:
            kept, self._kept = self._kept, {}
            for sample in kept.values():
                sample.free()
