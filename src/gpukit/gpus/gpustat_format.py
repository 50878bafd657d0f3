"""An inventory as ``gpustat --json`` prints it, so that scripts written for gpustat read gpukit.

>>> from gpukit.gpus.inventory import GPU, Inventory
>>> t4 = GPU(index=0, uuid="GPU-65", name="Tesla T4", memory_total=16106127360,
...          memory_used=1048576, power_draw_w=10.5, power_limit_w=70.0)
>>> gpu = gpustat_json(Inventory(gpus=(t4,), driver_version="550.90.07"))["gpus"][0]
>>> gpu["memory.used"], gpu["memory.total"], gpu["power.draw"], gpu["temperature.gpu"]
(1, 15360, 10, None)

The document is gpustat 1.1.1's (``GPUStatCollection.jsonify`` and ``new_query`` in
``gpustat/core.py``), key for key and unit for unit:

- ``hostname`` (``platform.node()``), ``driver_version``, ``query_time`` (local time, ISO 8601
  without a zone: ``2024-05-01T14:03:07.123456``), ``gpus``;
- per GPU: ``index``, ``uuid``, ``name``, ``temperature.gpu`` (°C), ``fan.speed``,
  ``utilization.gpu``, ``utilization.enc``, ``utilization.dec`` (percent), ``power.draw``,
  ``enforced.power.limit`` (whole watts, rounded down), ``memory.used``, ``memory.total`` (whole
  MiB, rounded down; gpustat calls them MB), ``processes``; ``null`` for a reading the GPU cannot
  give, and ``processes: null`` when NVML can list none. A GPU NVML cannot open at all is
  ``{"index": i, "name": "((GPU is lost))", "processes": null}``, as in gpustat;
- per process: ``username``, ``command`` (the program's base name), ``full_command`` (its
  arguments), ``gpu_memory_usage`` (whole MiB; ``null`` where the driver says none or 0),
  ``cpu_percent`` (over about 0.1 s, 100 per busy core), ``cpu_memory_usage`` (resident bytes),
  ``pid``.

gpustat reads processes with psutil; gpukit reads the same files of ``/proc`` with the same
rules, for a process that is, on this machine, the one the inventory lists (same owner and
command line). Where they differ, on purpose:

- gpustat leaves out a process it cannot find in ``/proc`` (one in another container's pid
  namespace); gpukit keeps it, since its GPU memory is real, with the user and command the
  inventory has (``"?"`` where unknown), its command line's words as ``full_command``, and
  gpustat's values for a process it cannot read: ``cpu_percent`` 0, ``cpu_memory_usage`` 0.0.
  The processes of a machine ``GPUKIT_FAKE_NVML`` describes are kept the same way.
- Processes come largest GPU memory first (gpustat: in NVML's order).
- Text others choose is made safe as everywhere in gpukit (:func:`gpukit.untrusted.printable`):
  a control character (a newline, an escape sequence) in a command line, a name or a user
  becomes ``?``, bytes that are not UTF-8 become U+FFFD (gpustat writes lone surrogates,
  ``\\udcff``, which strict JSON readers refuse), a GPU name is cut at 500 characters (NVML's
  are at most 96), and a command line is read up to 64 KiB.

Never imports gpustat or psutil.
"""

from __future__ import annotations

import os
import platform
import pwd
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpukit.gpus.inventory import GPU, GpuProcess, Inventory, _proc_owner_and_command
from gpukit.untrusted import printable

__all__ = ["gpustat_json"]

_MIB = 1 << 20
"""gpustat's ``MB``: memory is written in whole mebibytes."""
_ARGV_LIMIT = 64 << 10
"""The most bytes of a command line read: gpustat reads all of it, up to the kernel's limit."""
_CPU_SAMPLE_S = 0.1
"""The interval of ``cpu_percent``: gpustat sleeps 0.1 s between its two psutil readings."""
_UNREADABLE_CPU_PERCENT = 0
"""gpustat's ``cpu_percent`` for a process psutil cannot read."""
_UNREADABLE_CPU_MEMORY = 0.0
"""gpustat's ``cpu_memory_usage`` for a process psutil cannot read."""
_REAL_UID = re.compile(rb"Uid:\t(\d+)\t")


@dataclass(frozen=True)
class _Local:
    """What gpustat reads with psutil about a process of this machine."""

    username: str
    argv: tuple[str, ...]
    cpu_percent: float | int
    cpu_memory_usage: int | float


def gpustat_json(inv: Inventory) -> dict[str, Any]:
    """``inv`` as the document ``gpustat --json`` prints: the same keys, units and nulls.

    Reads this machine's processes as gpustat does (``/proc``, where psutil reads them), and
    takes about 0.1 s to do so when the GPUs have processes (gpustat's interval for
    ``cpu_percent``). The module says what differs from gpustat, and why.

    Args:
        inv: the reading to convert, from :func:`gpukit.gpus.inventory.inventory`.
    """
    local = _local_processes([p for g in inv.gpus for p in g.processes])
    return {
        "hostname": _safe(platform.node()),
        "driver_version": _safe(inv.driver_version),
        "query_time": datetime.fromtimestamp(inv.taken_at).isoformat(),
        "gpus": [_gpu(g, local) for g in inv.gpus],
    }


def _safe(text: str | None) -> str | None:
    """Text others chose, printable and cut (500 characters); None stays None."""
    return None if text is None else printable(text) or ""


def _gpu(gpu: GPU, local: dict[int, _Local]) -> dict[str, Any]:
    if gpu.error is not None:
        # gpustat's InvalidGPU: three keys, NVML's error in double brackets ("((GPU is lost))").
        return {"index": gpu.index, "name": f"(({_safe(gpu.error)}))", "processes": None}
    processes = None
    if gpu.processes_readable:
        processes = [_process(p, local.get(p.pid)) for p in gpu.processes]
    return {
        "index": gpu.index,
        "uuid": _safe(gpu.uuid),
        "name": _safe(gpu.name),
        "temperature.gpu": gpu.temperature_c,
        "fan.speed": gpu.fan_speed,
        "utilization.gpu": gpu.utilization_gpu,
        "utilization.enc": gpu.utilization_encoder,
        "utilization.dec": gpu.utilization_decoder,
        "power.draw": _whole_watts(gpu.power_draw_w),
        "enforced.power.limit": _whole_watts(gpu.power_limit_w),
        "memory.used": None if gpu.memory_used is None else gpu.memory_used // _MIB,
        "memory.total": None if gpu.memory_total is None else gpu.memory_total // _MIB,
        "processes": processes,
    }


def _whole_watts(watts: float | None) -> int | None:
    # NVML gives milliwatts and gpustat writes milliwatts // 1000; the inventory's watts are
    # milliwatts / 1000, from which the milliwatts come back exactly.
    return None if watts is None else round(watts * 1000) // 1000


def _process(process: GpuProcess, local: _Local | None) -> dict[str, Any]:
    if local is None:
        # Not found on this machine: what the inventory knows, and gpustat's values for a
        # process it cannot read.
        local = _Local(
            username=process.user or "?",
            argv=tuple((process.command or "").split()),
            cpu_percent=_UNREADABLE_CPU_PERCENT,
            cpu_memory_usage=_UNREADABLE_CPU_MEMORY,
        )
    return {
        "username": local.username,
        "command": os.path.basename(local.argv[0]) if local.argv else "?",
        "full_command": list(local.argv) or ["?"],
        # gpustat: `usedGpuMemory // MB if usedGpuMemory else None`, so 0 bytes is null too.
        "gpu_memory_usage": process.used_memory // _MIB if process.used_memory else None,
        "cpu_percent": local.cpu_percent,
        "cpu_memory_usage": local.cpu_memory_usage,
        "pid": process.pid,
    }


# -- the readings gpustat takes from psutil, from the same files ----------------------------


@dataclass(frozen=True)
class _Sample:
    """A process's readings before ``cpu_percent``'s interval."""

    username: str
    argv: tuple[str, ...]
    cpu_memory_usage: int | float
    cpu_seconds: float | None
    at: float
    """``time.monotonic()`` when ``cpu_seconds`` was read."""


def _local_processes(listed: list[GpuProcess]) -> dict[int, _Local]:
    """gpustat's readings of each listed process that is, on this machine, the one listed."""
    samples: dict[int, _Sample] = {}
    for process in {p.pid: p for p in listed}.values():
        sample = _sample(process)
        if sample is not None:
            samples[process.pid] = sample
    if samples:
        time.sleep(_CPU_SAMPLE_S)
    return {
        pid: _Local(s.username, s.argv, _cpu_percent(s, _cpu_seconds(pid)), s.cpu_memory_usage)
        for pid, s in samples.items()
    }


def _sample(process: GpuProcess) -> _Sample | None:
    """psutil's readings of ``process``'s pid here, or None when that pid is not the process
    the inventory lists (gone, in another pid namespace, or a described machine's)."""
    pid = process.pid
    user, command = _proc_owner_and_command(pid)
    if user is None or (process.user, process.command) != (printable(user), command):
        return None
    try:
        cmdline = _read(f"/proc/{pid}/cmdline", _ARGV_LIMIT)
    except OSError:
        cmdline = b""  # psutil's AccessDenied: gpustat shows "?"
    return _Sample(
        username=_username(pid),
        argv=tuple(printable(arg, limit=_ARGV_LIMIT) or "" for arg in _argv(cmdline)),
        cpu_memory_usage=_resident(pid),
        cpu_seconds=_cpu_seconds(pid),
        at=time.monotonic(),
    )


def _read(path: str, limit: int = 4096) -> bytes:
    with open(path, "rb") as f:
        return f.read(limit)


def _username(pid: int) -> str:
    """psutil's ``username()``: the real uid's account name, else the uid; ``"?"`` unreadable."""
    try:
        found = _REAL_UID.search(_read(f"/proc/{pid}/status", 1 << 16))
    except OSError:
        return "?"
    if found is None:
        return "?"
    uid = int(found.group(1))
    try:
        return printable(pwd.getpwuid(uid).pw_name) or str(uid)
    except KeyError:
        return str(uid)


def _argv(raw: bytes) -> list[str]:
    """psutil's ``cmdline()``: arguments split at NUL, or at spaces for a process that rewrote
    its command line as one string (setproctitle); undecodable bytes as U+FFFD.

    A command line cut at :data:`_ARGV_LIMIT` ends inside an argument, not at a NUL, and is
    split at NUL all the same, its last argument cut short.
    """
    data = raw.decode("utf-8", errors="replace")
    if not data:
        return []
    cut = len(raw) >= _ARGV_LIMIT and "\0" in data
    sep = "\0" if data.endswith("\0") or cut else " "
    if data.endswith(sep):
        data = data[:-1]
    args = data.split(sep)
    if sep == "\0" and len(args) == 1 and " " in data:
        args = data.split(" ")
    return args


def _cpu_seconds(pid: int) -> float | None:
    """User plus system time of ``pid`` (``/proc/<pid>/stat`` utime + stime), in seconds."""
    try:
        stat = _read(f"/proc/{pid}/stat")
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces and parentheses: count after the last.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError):
        return None


def _cpu_percent(before: _Sample, after: float | None) -> float | int:
    """psutil's ``cpu_percent()``: CPU time over wall time, 100 per busy core, one decimal."""
    elapsed = time.monotonic() - before.at
    if before.cpu_seconds is None or after is None:
        return _UNREADABLE_CPU_PERCENT
    if elapsed <= 0:
        return 0.0
    return round((after - before.cpu_seconds) / elapsed * 100, 1)


def _resident(pid: int) -> int | float:
    """gpustat's ``cpu_memory_usage``: psutil's memory percent of the RAM, back in bytes."""
    try:
        rss = int(_read(f"/proc/{pid}/statm").split()[1]) * os.sysconf("SC_PAGE_SIZE")
        total = _memory_total()
    except (OSError, IndexError, ValueError):
        return _UNREADABLE_CPU_MEMORY
    # gpustat: round((memory_percent() / 100.0) * virtual_memory().total), the percent being
    # rss / total * 100: the float steps are psutil's and gpustat's, so the bytes are theirs.
    return round((rss / float(total)) * 100 / 100.0 * total)


def _memory_total() -> int:
    """psutil's ``virtual_memory().total``: ``MemTotal`` of ``/proc/meminfo``, in bytes."""
    for line in _read("/proc/meminfo", 1 << 16).splitlines():
        if line.startswith(b"MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError("no MemTotal in /proc/meminfo")
