"""The readings under dcgm-exporter's names, so that dashboards built for it work unchanged.

NVIDIA's dcgm-exporter names each reading after its DCGM field (``DCGM_FI_DEV_GPU_TEMP``) and
keeps DCGM's units: MiB, percent, MHz, watts, Celsius. :func:`dcgm_families` gives the same
readings of an inventory under those names, with dcgm-exporter's labels, metric types and help
texts (those of its ``etc/default-counters.csv``), to be served beside gpukit's own names. A
reading the GPU cannot give has no sample, as in dcgm-exporter.

Only what NVML reads is served. Of the profiling fields (``DCGM_FI_PROF_*``), that is
``DCGM_FI_PROF_PIPE_TENSOR_ACTIVE`` on GPUs with GPU Performance Monitoring (Hopper and newer:
H100, H200, GH200, Blackwell), read between two samples (:mod:`gpukit.gpus.gpm`), so from the
second reading of ``gpukit serve`` on, as DCGM itself reads it on those GPUs. On older GPUs
(A100, Ada's L4 and L40, T4, GeForce) DCGM reads it from its own profiling module, which NVML
does not offer: there, as for the other profiling fields (SM and DRAM activity), nothing is
served rather than a made-up value, so a panel built on them shows "No data".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from gpukit.gpus.inventory import GPU, Inventory

LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION")
"""dcgm-exporter's labels on every GPU reading, spelled as its releases up to 4.5.3-4.8.2 write
them (``Hostname`` capitalised; ``DCGM_FI_DRIVER_VERSION`` comes from its default counters).
Prometheus reads an empty value as no label, as dcgm-exporter leaves out an unknown one."""

_MIB = 20  # DCGM divides NVML's bytes by 1024 * 1024, dropping the remainder


def _mib(size: int | None) -> int | None:
    # NVML's sizes are unsigned, so DCGM never reports less than 0 MiB. A fake machine's free
    # memory (total - used - reserved) falls below zero where its description over-counts
    # (GPU 6 of server-8xA100-shared): served as 0, as `gpukit pick` shows it.
    return None if size is None else max(size, 0) >> _MIB


@dataclass(frozen=True)
class _Field:
    """One DCGM field: its name, dcgm-exporter's help text, and its reading in DCGM's unit."""

    name: str
    help: str
    reading: Callable[[GPU], float | None]


# In the order of dcgm-exporter's default counters; every one is a gauge there too.
_FIELDS = (
    _Field("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", lambda g: g.clock_sm_mhz),
    _Field("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", lambda g: g.clock_mem_mhz),
    _Field("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda g: g.temperature_c),
    _Field("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda g: g.power_draw_w),
    _Field("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda g: g.utilization_gpu),
    _Field(
        "DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", lambda g: _mib(g.memory_free)
    ),
    _Field(
        "DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda g: _mib(g.memory_used)
    ),
)


# Not a reading of the inventory: GPM compares two readings, so the sampler gives it by UUID.
_TENSOR_ACTIVE = "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"
_TENSOR_ACTIVE_HELP = "Ratio of cycles the tensor (HMMA) pipe is active."


def _labels(g: GPU, inv: Inventory, host: str) -> list[str]:
    """A GPU's label values, in the order of :data:`LABELS`."""
    return [
        str(g.index),
        g.uuid,
        g.pci_bus_id or "",
        f"nvidia{g.index}",
        g.name,
        host,
        inv.driver_version or "",
    ]


def dcgm_families(
    inv: Inventory, host: str, tensor_active: Mapping[str, float] | None = None
) -> list[GaugeMetricFamily]:
    """Every GPU's readings as dcgm-exporter names them, one family per DCGM field.

    Memory is in whole MiB, rounded down as DCGM does (``nvidia-smi``'s ``memory.used`` in MiB);
    utilisation in percent, 0..100 (``utilization.gpu``); clocks in MHz (``clocks.sm``,
    ``clocks.mem``); power in watts (``power.draw``); temperature in Celsius
    (``temperature.gpu``); tensor activity a ratio, 0..1 (``nvidia-smi dmon --gpm-metrics 5``
    / 100), its family there only when some GPU has a value.

    Args:
        inv: the GPUs to describe.
        host: the ``Hostname`` label's value (dcgm-exporter's is the machine's host name).
        tensor_active: UUID -> share of the time any tensor pipe was active, 0..1
            (:class:`gpukit.gpus.gpm.TensorActivity`); a GPU not in it has no sample.
    """
    families = [GaugeMetricFamily(f.name, f.help, labels=LABELS) for f in _FIELDS]
    tensor = GaugeMetricFamily(_TENSOR_ACTIVE, _TENSOR_ACTIVE_HELP, labels=LABELS)
    for g in inv.gpus:
        labels = _labels(g, inv, host)
        for field, family in zip(_FIELDS, families, strict=True):
            value = field.reading(g)
            if value is not None:
                family.add_metric(labels, float(value))
        ratio = (tensor_active or {}).get(g.uuid) if g.uuid else None
        if ratio is not None:
            tensor.add_metric(labels, float(ratio))
    return [*families, tensor] if tensor.samples else families
