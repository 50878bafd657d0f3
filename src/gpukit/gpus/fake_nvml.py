"""A stand-in for the ``pynvml`` module (nvidia-ml-py), answering from a machine description.

Switched on for a whole process by ``GPUKIT_FAKE_NVML=<machine description file>``, or the name
of a machine shipped with gpukit (``GPUKIT_FAKE_NVML=server-8xA100-shared``; see
:func:`bundled_machines`), so that tests, bug reports and demos can show how gpukit behaves on
any machine without owning it. The
fake implements the nvidia-ml-py functions gpukit calls, under their real names, and fails the
way the real library fails: with real ``pynvml.NVMLError`` subclasses (``NotSupported`` for a
reading the description gives as ``null``, ``LibraryNotFound`` from ``nvmlInit`` on a machine
without a driver, ``Uninitialized`` before ``nvmlInit``). The code reading it is therefore the
code that reads a real GPU.

The description format (memory in bytes, power in milliwatts, temperature in Celsius,
utilisation in percent, ``null`` = not supported)::

    {"driver_version": "550.90.07", "cuda_driver_version": 12040,
     "nvml_error": "LibraryNotFound",            # optional: nvmlInit fails with this error
     "unsupported_functions": ["nvmlDeviceGetMemoryInfo_v2"],   # optional: FunctionNotFound
     "gpus": [{"index": 0, "uuid": "GPU-...", "name": "Tesla T4",
               "pci_bus_id": "00000000:00:04.0", "memory_total": 16106127360,
               "memory_used": 1048576, "memory_reserved": 0, "utilization_gpu": 0,
               "utilization_memory": 0, "temperature_c": 54, "power_usage_mw": 10000,
               "power_limit_mw": 70000, "compute_capability": [7, 5], "mig_mode": false,
               "processes": [{"pid": 1, "user": "me", "name": "python", "used_memory": 0}],
               "mig_devices": [{"mig_index": 0, "uuid": "MIG-...", "name": "...",
                                "memory_total": 0, "memory_used": 0, "processes": []}]}]}

Optional readings, so that older descriptions still load (absent reads as a GPU that cannot
give them): the current clocks in MHz, ``"clock_sm_mhz"`` and ``"clock_mem_mhz"``
(``nvidia-smi --query-gpu=clocks.sm,clocks.mem``); ``"fan_speed"`` (percent of the fan's
maximum); ``"utilization_encoder"`` and ``"utilization_decoder"`` (percent);
``"tensor_active_percent"`` (a number, 0..100): the GPU has GPU Performance Monitoring (GPM,
Hopper and newer) and its tensor pipes were active this percent of the time between any two GPM
samples (``NVML_GPM_METRIC_ANY_TENSOR_UTIL``). Without it (or ``null``) the GPU answers GPM as
one before Hopper does: ``nvmlGpmQueryDeviceSupport`` says unsupported and taking a sample fails
with ``NotSupported``. GPM samples are counted (:attr:`FakeNvml.gpm_allocated`,
:attr:`FakeNvml.gpm_freed`, and :func:`gpm_samples_held` for the whole process, as NVML holds
them), so that a test can see every sample freed.

Process owners and command lines are not NVML readings (gpukit reads them from ``/proc``), and
the pids of a described machine are not processes of this one, so the fake also offers
``gpukit_process_info(pid)``, which gpukit consults instead of ``/proc`` when present.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pynvml

from gpukit.errors import InvalidArgumentError
from gpukit.untrusted import InvalidInput, parse_json, read_file

ENV_VAR = "GPUKIT_FAKE_NVML"
_CODEC_PERIOD_US = 167_000
"""The sampling period the fake gives with encoder and decoder readings, in microseconds."""
_MAX_DESCRIPTION = 4 << 20
"""The largest machine description read: the biggest shipped one is a few kilobytes."""


@dataclass
class _GpmSample:
    """What a GPM sample holds: NVML's buffer, and what the fake wrote into it."""

    buffer: ctypes.Array[ctypes.c_char]
    gpu: int | None = None
    """The GPU it was last taken of; None: not taken yet."""
    percent: float | None = None
    """The described tensor activity when it was taken."""


# NVML's GPM buffers belong to the process, not to one nvmlInit: a fake made for one reading
# must compare a sample another one took (a described machine is read afresh each time).
_GPM_SAMPLES: dict[int, _GpmSample] = {}


def gpm_samples_held() -> int:
    """How many GPM samples fake NVML has allocated in this process and not freed yet."""
    return len(_GPM_SAMPLES)


@dataclass(frozen=True)
class _Handle:
    """What ``nvmlDeviceGetHandleByIndex`` returns: a GPU, or one MIG instance of it."""

    gpu: int
    mig: int | None = None


def _error(name: str) -> pynvml.NVMLError:
    """The real nvidia-ml-py exception for ``NVML_ERROR_<NAME>``, e.g. ``'NotSupported'``."""
    cls = getattr(pynvml, f"NVMLError_{name}", None)
    if cls is None:
        raise InvalidArgumentError(
            f"The machine description names NVML error {name!r}, which nvidia-ml-py does not have.",
            hint="Use a name such as LibraryNotFound, DriverNotLoaded or NotSupported.",
        )
    error: pynvml.NVMLError = cls()
    return error


def bundled_machines() -> list[str]:
    """The names of the machine descriptions shipped with gpukit, for ``GPUKIT_FAKE_NVML``.

    >>> "server-8xA100-shared" in bundled_machines()
    True
    """
    folder = resources.files("gpukit.gpus") / "machines"
    return sorted(f.name[: -len(".json")] for f in folder.iterdir() if f.name.endswith(".json"))


def _is_name(value: str) -> bool:
    # A bare name is always a bundled machine, whatever files the current folder holds, so that
    # a file someone left in a shared folder cannot stand in for it; a path says so with a
    # folder separator or the .json suffix.
    return "/" not in value and os.sep not in value and not value.endswith(".json")


def _read_regular_file(path: str) -> str:
    # The layer's open: a FIFO or a device would otherwise make every command hang, and a
    # description is a few kilobytes, never the gigabytes a sparse file can claim.
    try:
        return read_file(path, _MAX_DESCRIPTION, follow=True).decode("utf-8")
    except InvalidInput as exc:
        raise InvalidArgumentError(
            f"{ENV_VAR}={path} is {exc}.",
            hint="Point it at a JSON machine description file, or a bundled machine's name.",
        ) from None


def _read(path: str | Path) -> str:
    text = str(path)
    if not _is_name(text):
        return _read_regular_file(text)
    if text not in bundled_machines():
        raise InvalidArgumentError(
            f"{ENV_VAR}={text} is neither a machine gpukit ships nor a path.",
            hint=f"Use one of {', '.join(bundled_machines())}, or a path to a description "
            f"file (./{text}.json).",
        )
    folder = resources.files("gpukit.gpus") / "machines"
    return (folder / f"{text}.json").read_text(encoding="utf-8")


def load_description(path: str | Path) -> dict[str, Any]:
    """Read a machine description (a file, or a bundled machine's name), checked whole."""
    try:
        data = parse_json(_read(path), limit=_MAX_DESCRIPTION)
    except InvalidArgumentError:
        raise
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(
            f"{ENV_VAR}={path} does not name a readable machine description ({exc}).",
            hint=f"Point {ENV_VAR} at a JSON machine description, or unset it for the real GPUs.",
        ) from exc
    problems = check_description(data)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise InvalidArgumentError(
            f"{ENV_VAR}={path} is not a valid machine description: "
            + "; ".join(problems[:5])
            + more
            + ".",
            hint="Fix those fields; the format is in the gpukit.gpus.fake_nvml module docstring.",
        )
    description = cast(dict[str, Any], data)  # an object: check_description found no problem
    return description


# -- the description's format, checked whole before anything reads it --------------------------

_Check = Callable[[Any], str | None]  # None when the value is right, else what it should be


def _whole(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return None if ok else "a whole number, 0 or more"


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) else "a string"


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def _percent(value: Any) -> str | None:
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= 100
    )
    return None if ok else "a number from 0 to 100"


def _capability(value: Any) -> str | None:
    ok = isinstance(value, list) and len(value) == 2 and all(_whole(v) is None for v in value)
    return None if ok else "a [major, minor] pair of whole numbers"


def _or_null(check: _Check) -> _Check:
    def nullable(value: Any) -> str | None:
        wrong = None if value is None else check(value)
        return None if wrong is None else f"{wrong}, or null"

    return nullable


def _list_of(check: _Check) -> _Check:
    def items(value: Any) -> str | None:
        if not isinstance(value, list) or any(check(v) is not None for v in value):
            return f"a list of {check(object())} values"
        return None

    return items


_PROCESS: dict[str, _Check] = {
    "pid": _whole,
    "user": _or_null(_text),
    "name": _or_null(_text),
    "used_memory": _or_null(_whole),
}
_READINGS: dict[str, _Check] = {
    "uuid": _or_null(_text),
    "name": _or_null(_text),
    "memory_total": _or_null(_whole),
    "memory_used": _or_null(_whole),
    "memory_reserved": _or_null(_whole),
}
_MIG: dict[str, _Check] = {"mig_index": _whole, **_READINGS}
_GPU: dict[str, _Check] = {
    "index": _whole,
    **_READINGS,
    "pci_bus_id": _or_null(_text),
    "utilization_gpu": _or_null(_whole),
    "utilization_memory": _or_null(_whole),
    "temperature_c": _or_null(_whole),
    "power_usage_mw": _or_null(_whole),
    "power_limit_mw": _or_null(_whole),
    "compute_capability": _or_null(_capability),
    "multiprocessor_count": _or_null(_whole),
    "mig_mode": _or_null(_flag),
    "nvml_error": _or_null(_text),
    "clock_sm_mhz": _or_null(_whole),
    "clock_mem_mhz": _or_null(_whole),
    "fan_speed": _or_null(_whole),
    "utilization_encoder": _or_null(_whole),
    "utilization_decoder": _or_null(_whole),
    "tensor_active_percent": _or_null(_percent),
}
_MACHINE: dict[str, _Check] = {
    "description": _text,
    "units": _text,
    "driver_version": _or_null(_text),
    "cuda_driver_version": _or_null(_whole),
    "nvml_error": _or_null(_text),
    "unsupported_functions": _list_of(_text),
    "cuda_fastest_first_order": _list_of(_whole),
}
# Lists of records, checked entry by entry: (fields, fields each entry must have).
_RECORDS: dict[str, tuple[dict[str, _Check], frozenset[str]]] = {
    "gpus": (_GPU, frozenset()),
    "mig_devices": (_MIG, frozenset()),
    "processes": (_PROCESS, frozenset({"pid"})),
}
_NESTED = {"": ("gpus",), "gpus": ("processes", "mig_devices"), "mig_devices": ("processes",)}


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_record(
    record: Any, where: str, fields: dict[str, _Check], required: frozenset[str], level: str
) -> list[str]:
    label = where or "the description"
    if not isinstance(record, dict):
        return [f"{label} is {_kind(record)} {record!r:.40}, not an object ({{...}})"]
    problems = [f"{label} has no {name!r}" for name in sorted(required - set(record))]
    lists = _NESTED.get(level, ())
    for key, value in record.items():
        field = f"{where}.{key}" if where else key
        if key in lists:
            if not isinstance(value, list):
                problems.append(f"{field} is {_kind(value)}, not a list")
                continue
            entry_fields, entry_required = _RECORDS[key]
            for i, entry in enumerate(value):
                problems += _check_record(entry, f"{field}[{i}]", entry_fields, entry_required, key)
        elif key not in fields:
            known = ", ".join(sorted([*fields, *lists]))
            problems.append(f"{field} is not a field gpukit knows (known: {known})")
        else:
            wrong = fields[key](value)
            if wrong is not None:
                problems.append(f"{field} is {_kind(value)} {value!r:.40}, not {wrong}")
    return problems


def check_description(data: Any) -> list[str]:
    """Every problem of a machine description, each naming its field; empty when it is valid.

    >>> check_description({"gpus": [{"memory_total": "lots"}]})
    ["gpus[0].memory_total is str 'lots', not a whole number, 0 or more, or null"]
    """
    problems = _check_record(data, "", _MACHINE, frozenset({"gpus"}), "")
    return problems


class FakeNvml:
    """An object that behaves as the ``pynvml`` module for one described machine.

    >>> nvml = FakeNvml({"driver_version": "550.90.07", "gpus": []})
    >>> nvml.nvmlInit(); nvml.nvmlDeviceGetCount()
    0
    """

    def __init__(self, description: dict[str, Any], source: str = "<memory>") -> None:
        self.description = description
        self.source = source
        self._gpus: list[dict[str, Any]] = list(description.get("gpus", []))
        self._missing = set(description.get("unsupported_functions", []))
        self._initialised = 0
        self.gpm_allocated = 0
        """GPM samples allocated so far (``nvmlGpmSampleAlloc``)."""
        self.gpm_freed = 0
        """GPM samples freed so far (``nvmlGpmSampleFree``); a second free of one is refused."""

    @classmethod
    def from_file(cls, path: str | Path) -> FakeNvml:
        """The fake for the machine described in ``path``."""
        return cls(load_description(path), source=str(path))

    # Constants and exception classes are the real ones, so callers compare against the real
    # values; a function the fake lacks fails as a function missing from an old driver.
    def __getattr__(self, name: str) -> Any:
        if name.startswith("nvml") and not name.startswith("nvmlMemory"):
            return self._not_found(name)
        return getattr(pynvml, name)

    def _not_found(self, name: str) -> Callable[..., Any]:
        def missing(*args: object, **kwargs: object) -> Any:
            raise _error("FunctionNotFound")

        missing.__name__ = name
        return missing

    # -- helpers -------------------------------------------------------------------------------

    def _check(self, function: str) -> None:
        if function in self._missing:
            raise _error("FunctionNotFound")
        if not self._initialised:
            raise _error("Uninitialized")

    def _gpu(self, handle: _Handle) -> dict[str, Any]:
        return self._gpus[handle.gpu]

    def _entry(self, handle: _Handle) -> dict[str, Any]:
        gpu = self._gpu(handle)
        if handle.mig is None:
            return gpu
        return dict(gpu.get("mig_devices", [])[handle.mig])

    def _reading(self, handle: _Handle, key: str, function: str) -> Any:
        self._check(function)
        value = self._entry(handle).get(key)
        if value is None:
            raise _error("NotSupported")
        return value

    # -- system --------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        """``nvmlInit``: fails as the described machine's driver does."""
        if self.description.get("nvml_error"):
            raise _error(str(self.description["nvml_error"]))
        self._initialised += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.nvmlInit()

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self._initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return str(self.description.get("driver_version", ""))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check("nvmlSystemGetCudaDriverVersion")
        value = self.description.get("cuda_driver_version")
        if value is None:
            raise _error("NotSupported")
        return int(value)

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._check("nvmlSystemGetProcessName")
        for proc in self._all_processes():
            if proc["pid"] == pid:
                return str(proc.get("name", ""))
        raise _error("NotFound")

    def gpukit_process_info(self, pid: int) -> tuple[str | None, str | None]:
        """(user, command line) of a described process: not an NVML function, see the module."""
        for proc in self._all_processes():
            if proc["pid"] == pid:
                return proc.get("user"), proc.get("name")
        return None, None

    def _all_processes(self) -> list[dict[str, Any]]:
        procs: list[dict[str, Any]] = []
        for gpu in self._gpus:
            procs.extend(gpu.get("processes", []))
            for mig in gpu.get("mig_devices", []):
                procs.extend(mig.get("processes", []))
        return procs

    # -- devices -------------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self._gpus):
            raise _error("InvalidArgument")
        lost = self._gpus[index].get("nvml_error")  # e.g. "GpuIsLost": the GPU fell off the bus
        if lost:
            raise _error(str(lost))
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return str(self._reading(handle, "uuid", "nvmlDeviceGetUUID"))

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return str(self._reading(handle, "name", "nvmlDeviceGetName"))

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> SimpleNamespace:
        bus_id = self._reading(handle, "pci_bus_id", "nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=bus_id, busIdLegacy=bus_id[4:])

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        self._check("nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo")
        entry = self._entry(handle)
        total, used = entry.get("memory_total"), entry.get("memory_used")
        if total is None or used is None:
            raise _error("NotSupported")
        reserved = int(entry.get("memory_reserved") or 0)
        free = total - used - reserved
        if version:
            return SimpleNamespace(
                version=version, total=total, reserved=reserved, used=used, free=free
            )
        # The v1 query counts memory the driver reserves as used.
        return SimpleNamespace(total=total, free=free, used=used + reserved)

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:
        self._check("nvmlDeviceGetUtilizationRates")
        entry = self._entry(handle)
        gpu, mem = entry.get("utilization_gpu"), entry.get("utilization_memory")
        if gpu is None or mem is None:
            raise _error("NotSupported")
        return SimpleNamespace(gpu=gpu, memory=mem)

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        return int(self._reading(handle, "temperature_c", "nvmlDeviceGetTemperature"))

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        return int(self._reading(handle, "power_usage_mw", "nvmlDeviceGetPowerUsage"))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:
        return int(self._reading(handle, "power_limit_mw", "nvmlDeviceGetEnforcedPowerLimit"))

    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple[int, int]:
        major, minor = self._reading(
            handle, "compute_capability", "nvmlDeviceGetCudaComputeCapability"
        )
        return int(major), int(minor)

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        mode = self._reading(handle, "mig_mode", "nvmlDeviceGetMigMode")
        return [int(bool(mode)), int(bool(mode))]

    def nvmlDeviceIsMigDeviceHandle(self, handle: _Handle) -> bool:
        self._check("nvmlDeviceIsMigDeviceHandle")
        return handle.mig is not None

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        self._check("nvmlDeviceGetMaxMigDeviceCount")
        if not self._gpu(handle).get("mig_mode"):
            raise _error("NotSupported")
        # Like a real GPU, more slots than instances: the empty ones answer NotFound.
        return len(self._gpu(handle).get("mig_devices", [])) + 1

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        self._check("nvmlDeviceGetMigDeviceHandleByIndex")
        if not 0 <= index < len(self._gpu(handle).get("mig_devices", [])):
            raise _error("NotFound")
        return _Handle(handle.gpu, index)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[SimpleNamespace]:
        self._check("nvmlDeviceGetComputeRunningProcesses")
        entry = self._entry(handle)
        procs = list(entry.get("processes", []))
        if handle.mig is None:
            # On a MIG-mode GPU the parent handle reports the processes of every instance.
            for mig in entry.get("mig_devices", []):
                procs.extend(mig.get("processes", []))
        return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p.get("used_memory")) for p in procs]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: _Handle) -> list[SimpleNamespace]:
        self._check("nvmlDeviceGetGraphicsRunningProcesses")
        return []

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock_type: int) -> int:
        """The current SM or memory clock in MHz; any other clock is not described."""
        keys = {pynvml.NVML_CLOCK_SM: "clock_sm_mhz", pynvml.NVML_CLOCK_MEM: "clock_mem_mhz"}
        if clock_type not in keys:
            self._check("nvmlDeviceGetClockInfo")
            raise _error("NotSupported")
        return int(self._reading(handle, keys[clock_type], "nvmlDeviceGetClockInfo"))

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        """The GPU's NVML index: its place in the description's ``gpus`` (as gpustat asks it)."""
        self._check("nvmlDeviceGetIndex")
        return handle.gpu

    def nvmlDeviceGetFanSpeed(self, handle: _Handle) -> int:
        """Percent of the fan's maximum speed (``fan.speed``)."""
        return int(self._reading(handle, "fan_speed", "nvmlDeviceGetFanSpeed"))

    def nvmlDeviceGetEncoderUtilization(self, handle: _Handle) -> list[int]:
        """``[percent, sampling period in µs]``, as nvidia-ml-py returns it."""
        percent = self._reading(handle, "utilization_encoder", "nvmlDeviceGetEncoderUtilization")
        return [int(percent), _CODEC_PERIOD_US]

    def nvmlDeviceGetDecoderUtilization(self, handle: _Handle) -> list[int]:
        """``[percent, sampling period in µs]``, as nvidia-ml-py returns it."""
        percent = self._reading(handle, "utilization_decoder", "nvmlDeviceGetDecoderUtilization")
        return [int(percent), _CODEC_PERIOD_US]

    # -- GPU Performance Monitoring (GPM) ------------------------------------------------------

    def _gpm_percent(self, handle: _Handle) -> float | None:
        """The described tensor activity of a whole GPU with GPM; None: no GPM there."""
        if handle.mig is not None:  # a MIG instance is sampled through its GPU, not its handle
            return None
        value = self._gpu(handle).get("tensor_active_percent")
        return None if value is None else float(value)

    def _gpm_sample(self, sample: Any) -> _GpmSample:
        """The live sample behind an ``nvmlGpmSample_t``; a freed or foreign one is refused."""
        found = _GPM_SAMPLES.get(ctypes.cast(sample, ctypes.c_void_p).value or 0)
        if found is None:
            raise _error("InvalidArgument")
        return found

    def nvmlGpmQueryDeviceSupport(self, handle: _Handle) -> Any:
        """Whether the GPU has GPM: a ``c_nvmlGpmSupport_t``, as nvidia-ml-py returns it."""
        self._check("nvmlGpmQueryDeviceSupport")
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(self._gpm_percent(handle) is not None)
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        """A new GPM sample buffer, which the caller frees with :meth:`nvmlGpmSampleFree`."""
        self._check("nvmlGpmSampleAlloc")
        buffer = ctypes.create_string_buffer(1)
        _GPM_SAMPLES[ctypes.addressof(buffer)] = _GpmSample(buffer)
        self.gpm_allocated += 1
        return ctypes.cast(buffer, pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        """Free a sample; one freed already, or never allocated here, is InvalidArgument."""
        self._check("nvmlGpmSampleFree")
        self._gpm_sample(sample)
        del _GPM_SAMPLES[ctypes.cast(sample, ctypes.c_void_p).value or 0]
        self.gpm_freed += 1

    def nvmlGpmSampleGet(self, handle: _Handle, sample: Any) -> Any:
        """Take a sample of the GPU into ``sample``; NotSupported on a GPU without GPM."""
        self._check("nvmlGpmSampleGet")
        percent = self._gpm_percent(handle)
        if percent is None:
            raise _error("NotSupported")
        taken = self._gpm_sample(sample)
        taken.gpu, taken.percent = handle.gpu, percent
        return sample

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        """Each requested metric between ``request.sample1`` and ``request.sample2``: the
        described tensor activity for ``NVML_GPM_METRIC_ANY_TENSOR_UTIL``, NotSupported in the
        metric's own ``nvmlReturn`` for any other."""
        self._check("nvmlGpmMetricsGet")
        if request.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise _error("ArgumentVersionMismatch")
        first, second = self._gpm_sample(request.sample1), self._gpm_sample(request.sample2)
        if first.gpu is None or first.gpu != second.gpu or second.percent is None:
            raise _error("InvalidArgument")  # not taken, or taken of two different GPUs
        if not 0 < request.numMetrics <= pynvml.NVML_GPM_METRIC_MAX:
            raise _error("InvalidArgument")
        for metric in request.metrics[: request.numMetrics]:
            if metric.metricId == pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL:
                metric.nvmlReturn, metric.value = pynvml.NVML_SUCCESS, second.percent
            else:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return request
