"""The Prometheus metrics of one sample, rendered by prometheus_client.

Names follow Prometheus conventions: base units (bytes, watts, Celsius), ratios in 0..1, a
``gpu`` label holding nvidia-smi's index. A reading the device cannot give has no sample at all
(absent, not NaN), as the exporters do. Each name's ``nvidia-smi`` twin is in its help text so a
reader can check a value by hand.

The same GPU readings are also served under dcgm-exporter's names, labels and units
(:mod:`gpukit.serve.dcgm`), so that dashboards built for it read gpukit unchanged.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from gpukit.serve.dcgm import dcgm_families

if TYPE_CHECKING:
    from gpukit.gpus.inventory import Inventory
    from gpukit.sharing.report import Sharing

_COMMAND_CHARS = 120  # a label, not a log: long command lines are cut


def _text(value: object, limit: int = 64) -> str:
    """A label value from a record others may have written: a string, cut to ``limit``."""
    return "" if value is None else str(value)[:limit]


class _SampleCollector(Collector):
    def __init__(
        self,
        inv: Inventory | None,
        queue: Sharing | None,
        ok: bool,
        stale: bool,
        host: str,
        tensor_active: Mapping[str, float] | None = None,
    ) -> None:
        self.inv = inv
        self.host = host
        self.tensor_active = tensor_active
        self.ok = ok
        self.stale = stale
        self.claims_known = queue is not None
        self.waiters = None if queue is None else len(queue.waiters)
        # GPU index -> holder's user; None when the lock folder was refused (claims unknown).
        self.holders: dict[int, str | None] | None = None
        if queue is not None:
            self.holders = {
                index: holder.user
                for holder in queue.holders
                for index in holder.gpus
                if index is not None
            }

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "gpukit_nvml_up", "1 when the last sample read NVML, 0 when it failed"
        )
        up.add_metric([], 1.0 if self.ok and self.inv is not None else 0.0)
        yield up
        claims_up = GaugeMetricFamily(
            "gpukit_claims_up",
            "1 when the last sample read the claims and the line of waiters, 0 when they are "
            "unknown (lock folder refused or unreadable)",
        )
        claims_up.add_metric([], 1.0 if self.claims_known else 0.0)
        yield claims_up
        stale = GaugeMetricFamily(
            "gpukit_sample_stale",
            "1 when any part of the last sample failed (see the dashboard for which and why)",
        )
        stale.add_metric([], 1.0 if self.stale else 0.0)
        yield stale
        waiters = GaugeMetricFamily(
            "gpukit_waiters", "Processes waiting in line for GPUs (gpukit run --wait)"
        )
        if self.waiters is not None:  # unknown when the lock folder was refused: no sample
            waiters.add_metric([], float(self.waiters))
        yield waiters
        if self.inv is None:
            return
        yield from self._gpus(self.inv)
        yield from dcgm_families(self.inv, self.host, self.tensor_active)

    def _gpus(self, inv: Inventory) -> Iterator[Metric]:
        gpu = ["gpu"]
        info = InfoMetricFamily(
            "gpukit_gpu", "GPU identity (nvidia-smi -L)", labels=["gpu", "uuid", "name", "driver"]
        )
        families = {
            "used": GaugeMetricFamily(
                "gpukit_gpu_memory_used_bytes", "Memory in use (memory.used)", labels=gpu
            ),
            "total": GaugeMetricFamily(
                "gpukit_gpu_memory_total_bytes", "Memory on the GPU (memory.total)", labels=gpu
            ),
            "util": GaugeMetricFamily(
                "gpukit_gpu_utilization_ratio",
                "Share of the last sample period a kernel ran, 0..1 (utilization.gpu / 100)",
                labels=gpu,
            ),
            "temp": GaugeMetricFamily(
                "gpukit_gpu_temperature_celsius", "Core temperature (temperature.gpu)", labels=gpu
            ),
            "power": GaugeMetricFamily(
                "gpukit_gpu_power_watts", "Power draw (power.draw)", labels=gpu
            ),
            "limit": GaugeMetricFamily(
                "gpukit_gpu_power_limit_watts",
                "Enforced power limit (enforced.power.limit)",
                labels=gpu,
            ),
        }
        procs = GaugeMetricFamily(
            "gpukit_process_gpu_memory_bytes",
            "GPU memory of a process (nvidia-smi --query-compute-apps=pid,used_memory)",
            labels=["gpu", "pid", "user", "command"],
        )
        claimed = GaugeMetricFamily(
            "gpukit_gpu_claimed",
            '1 while a gpukit user holds the GPU (gpukit run, gk.claim), else 0 with user=""',
            labels=["gpu", "user"],
        )
        mig_labels = ["gpu", "mig", "uuid", "name"]
        mig_used = GaugeMetricFamily(
            "gpukit_mig_memory_used_bytes", "Memory in use in a MIG instance", labels=mig_labels
        )
        mig_total = GaugeMetricFamily(
            "gpukit_mig_memory_total_bytes", "Memory of a MIG instance", labels=mig_labels
        )
        driver = _text(inv.driver_version)
        for g in inv.gpus:
            index = str(g.index)
            info.add_metric([index, g.uuid, g.name, driver], {})
            readings = {
                "used": g.memory_used,
                "total": g.memory_total,
                "util": None if g.utilization_gpu is None else g.utilization_gpu / 100,
                "temp": g.temperature_c,
                "power": g.power_draw_w,
                "limit": g.power_limit_w,
            }
            for key, value in readings.items():
                if value is not None:
                    families[key].add_metric([index], float(value))
            seen: set[int] = set()
            for p in g.processes:
                if p.used_memory is None or p.pid in seen:
                    continue
                seen.add(p.pid)
                procs.add_metric(
                    [index, str(p.pid), _text(p.user), _text(p.command, _COMMAND_CHARS)],
                    float(p.used_memory),
                )
            if self.holders is not None:
                held = g.index in self.holders
                user = _text(self.holders.get(g.index)) or ("?" if held else "")
                claimed.add_metric([index, user], 1.0 if held else 0.0)
            for m in g.mig_instances:
                labels = [index, str(m.index), m.uuid, _text(m.name)]
                if m.memory_used is not None:
                    mig_used.add_metric(labels, float(m.memory_used))
                if m.memory_total is not None:
                    mig_total.add_metric(labels, float(m.memory_total))
        yield info
        yield from families.values()
        yield procs
        yield claimed
        yield mig_used
        yield mig_total


def exposition(
    inv: Inventory | None,
    queue: Sharing | None,
    *,
    ok: bool = True,
    stale: bool | None = None,
    host: str | None = None,
    tensor_active: Mapping[str, float] | None = None,
) -> bytes:
    """The Prometheus text exposition of one sample (what ``/metrics`` answers).

    ``queue`` is ``gpukit queue``'s snapshot (holders, waiters), ``None`` when unknown. ``ok``
    says NVML was read; ``stale`` that some part of the sample failed (by default: NVML not
    read or claims unknown). ``host`` is the machine's name on the dcgm-exporter names
    (their ``Hostname`` label); None: this machine's host name. ``tensor_active`` maps a GPU's
    UUID to the share of the time its tensor pipes were active since the previous sample
    (GPM, :mod:`gpukit.gpus.gpm`), served as ``DCGM_FI_PROF_PIPE_TENSOR_ACTIVE``.
    """
    if stale is None:
        stale = not ok or queue is None
    if host is None:
        host = socket.gethostname()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SampleCollector(inv, queue, ok, stale, host, tensor_active))
    return generate_latest(registry)
