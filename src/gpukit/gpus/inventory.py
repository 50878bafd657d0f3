"""What GPUs this machine has and how busy they are, read from NVML (nvidia-ml-py).

>>> import gpukit as gk
>>> inv = gk.inventory()                     # raises NoDriverError without an NVIDIA driver
>>> [(g.index, g.name, g.memory_free) for g in inv.gpus]      # doctest: +SKIP
[(0, 'Tesla T4', 16104030208), (1, 'Tesla T4', 16104030208)]

Indices are NVML's, the order of ``nvidia-smi`` (PCI bus order); CUDA's own numbering can
differ, see :mod:`gpukit.gpus.visible`. A reading a device cannot give is ``None`` ("n/a"), never an
exception. nvidia-ml-py is imported on first use and torch never, so ``gpukit list`` starts fast.

Setting ``GPUKIT_FAKE_NVML=<machine description file>`` makes every reading in the process come
from that description instead (see :mod:`gpukit.gpus.fake_nvml`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from gpukit.errors import InvalidArgumentError, NoDriverError, NvmlError
from gpukit.holders import user_name
from gpukit.untrusted import InvalidInput, parse_json, printable

SCHEMA = "gpukit.inventory/1"
_MAX_JSON = 64 << 20
"""The largest inventory JSON read back: thousands of GPUs with their processes."""
"""The ``schema`` field of :meth:`Inventory.to_json`; the number grows when a field changes."""


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU (``nvidia-smi --query-compute-apps=pid,used_memory``).

    ``user`` and ``command`` come from ``/proc`` and are ``None`` for a process this one cannot
    see (another container's, or a pid namespace apart).
    """

    pid: int
    user: str | None
    command: str | None
    used_memory: int | None
    """Bytes of GPU memory, or ``None`` where the driver does not say (Windows WDDM)."""


@dataclass(frozen=True)
class MigInstance:
    """One MIG instance of a GPU in MIG mode (``nvidia-smi -L`` lists them with their UUIDs)."""

    index: int
    """The instance's slot on its GPU (NVML's MIG device index)."""
    uuid: str
    """``MIG-...``: the value to put in CUDA_VISIBLE_DEVICES to use this instance."""
    name: str | None
    memory_total: int | None
    memory_used: int | None
    processes: tuple[GpuProcess, ...] = ()

    @property
    def memory_free(self) -> int | None:
        """Bytes not in use, or ``None`` when memory readings are not available."""
        if self.memory_total is None or self.memory_used is None:
            return None
        return self.memory_total - self.memory_used


@dataclass(frozen=True)
class GPU:
    """One physical GPU as NVML sees it. Memory in bytes, power in watts, temperature in °C."""

    index: int
    """NVML index: ``nvidia-smi``'s numbering, in PCI bus order."""
    uuid: str
    """``GPU-...``: stable across reboots and orderings; what claims and locks key on."""
    name: str
    pci_bus_id: str | None = None
    memory_total: int | None = None
    memory_used: int | None = None
    """Used by processes and contexts; excludes ``memory_reserved`` when the driver separates it."""
    memory_free: int | None = None
    memory_reserved: int | None = None
    """Set aside by the driver; ``None`` where only the older memory query is available."""
    utilization_gpu: int | None = None
    """Percent of the last sample period a kernel ran (``utilization.gpu``)."""
    utilization_memory: int | None = None
    temperature_c: int | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    compute_capability: tuple[int, int] | None = None
    mig_mode: bool | None = None
    """True when MIG is on; ``None`` on GPUs without MIG support."""
    mig_instances: tuple[MigInstance, ...] = ()
    processes: tuple[GpuProcess, ...] = ()
    """Every process on the GPU, those running inside its MIG instances included."""
    error: str | None = None
    """Why NVML could not read this GPU at all (e.g. "GPU is lost"); its readings are then None."""
    clock_sm_mhz: int | None = None
    """Current SM clock in MHz (``clocks.sm``)."""
    clock_mem_mhz: int | None = None
    """Current memory clock in MHz (``clocks.mem``)."""
    fan_speed: int | None = None
    """Percent of the fan's maximum speed (``fan.speed``); None for a GPU without a fan of its
    own (passively cooled datacenter GPUs, most laptops)."""
    utilization_encoder: int | None = None
    """Percent of the last sample period the video encoder ran (NVENC; ``utilization.encoder``)."""
    utilization_decoder: int | None = None
    """Percent of the last sample period the video decoder ran (NVDEC; ``utilization.decoder``)."""
    processes_readable: bool = True
    """False when NVML can list none of this GPU's processes (neither its compute nor its
    graphics query is supported): ``processes`` is then empty for want of a reading."""


@dataclass(frozen=True)
class Inventory:
    """Every GPU of the machine at one moment, with the driver that reported them.

    Args:
        gpus: the GPUs, in NVML index order.
        driver_version: the NVIDIA driver's version (``"550.54.15"``); None: unknown.
        cuda_driver_version: the newest CUDA version the driver supports; None: unknown.
        taken_at: when the reading was taken, in Unix seconds (now, by default).
        elapsed_s: how long the reading took, in seconds (0).
        source: ``"nvml"`` (the default) or ``"fake:<file>"``.
    """

    gpus: tuple[GPU, ...]
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    """The newest CUDA version the driver supports, e.g. ``'12.4'``."""
    taken_at: float = field(default_factory=time.time)
    """Unix time of the reading."""
    elapsed_s: float = 0.0
    """Seconds the reading took."""
    source: str = "nvml"
    """``'nvml'``, or ``'fake:<file>'`` when GPUKIT_FAKE_NVML supplied the machine."""

    def gpu(self, key: int | str) -> GPU:
        """The GPU with NVML index ``key``, or whose UUID (or a unique prefix of it) is ``key``.

        Args:
            key: an NVML index (an int), or a UUID or a prefix of one (``"GPU-5a1c"``).

        Raises:
            InvalidArgumentError: ``key`` is no index or UUID (a bool, an empty string), or no
                GPU, or more than one, matches it.
        """
        if isinstance(key, bool) or not isinstance(key, int | str) or key == "":
            raise InvalidArgumentError(
                f"Inventory.gpu({key!r}): a GPU is named by its NVML index or its UUID.",
                hint="Pass an int index or a GPU- UUID (or a prefix of one) from `gpukit list`.",
            )
        if isinstance(key, int):
            found = [g for g in self.gpus if g.index == key]
        else:
            found = [g for g in self.gpus if g.uuid.startswith(key)]
        if len(found) != 1:
            known = ", ".join(f"{g.index} ({g.uuid})" for g in self.gpus) or "none"
            raise InvalidArgumentError(
                f"No single GPU matches {key!r}: this machine has {known}.",
                hint="Use an NVML index or a GPU- UUID from `gpukit list`.",
            )
        return found[0]

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict with a ``schema`` field; :meth:`from_json` reads it back."""
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> Inventory:
        """Rebuild an Inventory from :meth:`to_json`'s dict or its JSON text.

        Unknown keys are ignored, so a newer writer's additions do not break an older reader.

        Args:
            data: the dict :meth:`to_json` returns, or its JSON text (at most 64 MiB).

        Raises:
            InvalidArgumentError: the text is not JSON, too large or too deep, its schema is
                another's, or an entry is missing or malformed.
        """
        try:
            payload: Any = parse_json(data, limit=_MAX_JSON) if isinstance(data, str) else data
        except InvalidInput as exc:
            raise InvalidArgumentError(
                f"Cannot read inventory JSON: {exc}.",
                hint="Produce it with `gpukit list --json` or Inventory.to_json().",
            ) from None
        schema = payload.get("schema") if isinstance(payload, Mapping) else None
        if schema != SCHEMA:
            raise InvalidArgumentError(
                f"Cannot read inventory JSON with schema {schema!r}: this gpukit reads {SCHEMA!r}.",
                hint="Produce it with the same gpukit version (`gpukit list --json`).",
            )
        try:
            return cls(
                gpus=tuple(_gpu_from_json(g) for g in payload["gpus"]),
                driver_version=payload.get("driver_version"),
                cuda_driver_version=payload.get("cuda_driver_version"),
                taken_at=float(payload.get("taken_at", 0.0)),
                elapsed_s=float(payload.get("elapsed_s", 0.0)),
                source=str(payload.get("source", "nvml")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidArgumentError(
                f"The inventory JSON is incomplete or malformed ({exc!r}).",
                hint="Produce it with `gpukit list --json` or Inventory.to_json().",
            ) from exc


def _fields(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    names = cls.__dataclass_fields__  # type: ignore[attr-defined]
    return {k: v for k, v in data.items() if k in names}


def _procs_from_json(items: Any) -> tuple[GpuProcess, ...]:
    return tuple(GpuProcess(**_fields(GpuProcess, p)) for p in items)


def _gpu_from_json(data: Mapping[str, Any]) -> GPU:
    values = _fields(GPU, data)
    cc = values.get("compute_capability")
    values["compute_capability"] = None if cc is None else (int(cc[0]), int(cc[1]))
    values["processes"] = _procs_from_json(values.get("processes", ()))
    values["mig_instances"] = tuple(
        MigInstance(**{**_fields(MigInstance, m), "processes": _procs_from_json(m["processes"])})
        for m in values.get("mig_instances", ())
    )
    return GPU(**values)


# -- reading NVML ------------------------------------------------------------------------------

# Errors that mean "this device cannot give this reading": the reading becomes None. Any other
# NVML error is a broken driver or a bug and is raised as NvmlError.
_NOT_AVAILABLE = (
    "NotSupported",
    "NoPermission",
    "FunctionNotFound",
    "NotFound",
    "InvalidArgument",
    "GpuIsLost",
    "ArgumentVersionMismatch",
)
# Errors of nvmlInit that mean there is no usable driver on this machine.
_NO_DRIVER = ("LibraryNotFound", "DriverNotLoaded", "NoPermission", "LibRmVersionMismatch")

_sessions: dict[str, Any] = {}


def _error_classes(nvml: Any, names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    return tuple(c for c in (getattr(nvml, f"NVMLError_{n}", None) for n in names) if c)


def _load_nvml() -> tuple[Any, str]:
    """The pynvml module (or the fake one) and a name for where readings come from."""
    fake = os.environ.get("GPUKIT_FAKE_NVML")
    if fake:
        from gpukit.gpus.fake_nvml import FakeNvml

        return FakeNvml.from_file(fake), f"fake:{fake}"
    try:
        import pynvml
    except ImportError as exc:
        raise NoDriverError(
            "Cannot read GPUs: the nvidia-ml-py package (module pynvml) is not installed.",
            hint="Install it with `pip install nvidia-ml-py`.",
        ) from exc
    return pynvml, "nvml"


def _session() -> tuple[Any, str]:
    """An initialised NVML, kept for the life of the process so that --watch stays cheap.

    A fake machine is re-read on every call instead, so that editing its file changes what
    the next reading shows.
    """
    nvml, source = _load_nvml()
    if source in _sessions:
        return _sessions[source], source
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        if isinstance(exc, _error_classes(nvml, _NO_DRIVER)):
            raise NoDriverError(
                f"No NVIDIA driver: NVML could not be started ({exc}).",
                hint="Install the NVIDIA driver (`nvidia-smi` should then work) or run on a "
                "machine with an NVIDIA GPU; gpukit's CPU features work without one.",
            ) from exc
        raise NvmlError(f"NVML failed to start: {exc}.", hint=_REPORT_HINT) from exc
    if source == "nvml":
        _sessions[source] = nvml
    return nvml, source


_REPORT_HINT = "Check `nvidia-smi`; if it works, please report this with `gpukit info --json`."


class _Reader:
    """Calls NVML, turning 'this device cannot' into None and other failures into NvmlError."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.not_available = _error_classes(nvml, _NOT_AVAILABLE)

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self.not_available:
            return None
        except self.nvml.NVMLError as exc:
            name = getattr(fn, "__name__", "NVML")
            raise NvmlError(f"{name} failed: {exc}.", hint=_REPORT_HINT) from exc


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _watts(milliwatts: int | None) -> float | None:
    return None if milliwatts is None else milliwatts / 1000.0


def _memory(read: _Reader, handle: Any) -> tuple[int | None, int | None, int | None, int | None]:
    """(total, used, free, reserved): the v2 query, which separates reserved memory, else v1."""
    nvml = read.nvml
    version = getattr(nvml, "nvmlMemory_v2", None)
    info = None
    if version is not None:
        try:
            info = read(nvml.nvmlDeviceGetMemoryInfo, handle, version=version)
        except TypeError:  # an nvidia-ml-py too old to take a version
            info = None
    if info is not None:
        return int(info.total), int(info.used), int(info.free), int(info.reserved)
    info = read(nvml.nvmlDeviceGetMemoryInfo, handle)
    if info is None:
        return None, None, None, None
    return int(info.total), int(info.used), int(info.free), None


# Anyone chooses their process's argv, and gpukit list and queue show it on others' terminals.
_COMMAND_LIMIT = 4096


def _proc_owner_and_command(pid: int) -> tuple[str | None, str | None]:
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None, None
    text = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return user_name(uid), printable(text, limit=_COMMAND_LIMIT)


def _processes(read: _Reader, handle: Any) -> tuple[GpuProcess, ...] | None:
    """The processes on ``handle``; None when NVML can list them by neither query."""
    nvml = read.nvml
    found: dict[int, int | None] = {}
    answers = [
        read(query, handle)
        for query in (
            nvml.nvmlDeviceGetComputeRunningProcesses,
            nvml.nvmlDeviceGetGraphicsRunningProcesses,
        )
    ]
    if all(answer is None for answer in answers):
        return None
    for answer in answers:
        for p in answer or ():
            # A process with both a compute and a graphics context is listed twice.
            memory = getattr(p, "usedGpuMemory", None)
            found[int(p.pid)] = max(filter(None, (found.get(int(p.pid)), memory)), default=memory)
    describe = getattr(nvml, "gpukit_process_info", _proc_owner_and_command)
    procs = []
    for pid, memory in found.items():
        user, command = describe(pid)
        if command is None:
            command = _text(read(nvml.nvmlSystemGetProcessName, pid))
        command = printable(command, limit=_COMMAND_LIMIT)
        user = printable(user)
        procs.append(GpuProcess(pid=pid, user=user, command=command, used_memory=memory))
    return tuple(sorted(procs, key=lambda p: -(p.used_memory or 0)))


def _mig_instances(read: _Reader, handle: Any) -> tuple[MigInstance, ...]:
    nvml = read.nvml
    instances = []
    for slot in range(read(nvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0):
        mig = read(nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
        if mig is None:  # an empty slot
            continue
        total, used, _, _ = _memory(read, mig)
        instances.append(
            MigInstance(
                index=slot,
                uuid=_text(read(nvml.nvmlDeviceGetUUID, mig)) or "",
                name=_text(read(nvml.nvmlDeviceGetName, mig)),
                memory_total=total,
                memory_used=used,
                processes=_processes(read, mig) or (),
            )
        )
    return tuple(instances)


def _read_gpu(read: _Reader, index: int) -> GPU:
    nvml = read.nvml
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except nvml.NVMLError as exc:
        # One fallen GPU (Xid 79, "GPU is lost") must not hide the others, as in nvidia-smi.
        return GPU(index=index, uuid="", name="unreadable GPU", error=str(exc))
    total, used, free, reserved = _memory(read, handle)
    util = read(nvml.nvmlDeviceGetUtilizationRates, handle)
    pci = read(nvml.nvmlDeviceGetPciInfo, handle)
    mig = read(nvml.nvmlDeviceGetMigMode, handle)
    mig_on = None if mig is None else bool(mig[0])
    cc = read(nvml.nvmlDeviceGetCudaComputeCapability, handle)
    processes = _processes(read, handle)
    return GPU(
        index=index,
        uuid=_text(read(nvml.nvmlDeviceGetUUID, handle)) or "",
        name=_text(read(nvml.nvmlDeviceGetName, handle)) or "unknown GPU",
        pci_bus_id=None if pci is None else _text(pci.busId),
        memory_total=total,
        memory_used=used,
        memory_free=free,
        memory_reserved=reserved,
        utilization_gpu=None if util is None else int(util.gpu),
        utilization_memory=None if util is None else int(util.memory),
        temperature_c=read(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
        power_draw_w=_watts(read(nvml.nvmlDeviceGetPowerUsage, handle)),
        power_limit_w=_watts(read(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)),
        compute_capability=None if cc is None else (int(cc[0]), int(cc[1])),
        mig_mode=mig_on,
        mig_instances=_mig_instances(read, handle) if mig_on else (),
        processes=processes or (),
        clock_sm_mhz=read(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
        clock_mem_mhz=read(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM),
        fan_speed=read(nvml.nvmlDeviceGetFanSpeed, handle),
        utilization_encoder=_codec(read(nvml.nvmlDeviceGetEncoderUtilization, handle)),
        utilization_decoder=_codec(read(nvml.nvmlDeviceGetDecoderUtilization, handle)),
        processes_readable=processes is not None,
    )


def _codec(value: list[int] | None) -> int | None:
    """The percent of an encoder or decoder reading, which NVML gives as [percent, period µs]."""
    return None if value is None else int(value[0])


def _cuda_version(value: int | None) -> str | None:
    return None if value is None else f"{value // 1000}.{value % 1000 // 10}"


def inventory() -> Inventory:
    """Read every GPU from NVML: memory, load, temperature, power, processes, MIG instances.

    Raises:
        NoDriverError: no NVIDIA driver, or no NVML (the nvidia-ml-py package), on this
            machine (exit 3).
        NvmlError: NVML started but could not list the GPUs.
        InvalidArgumentError: ``GPUKIT_FAKE_NVML`` names a machine description gpukit
            refuses (exit 2).
    """
    start = time.perf_counter()
    nvml, source = _session()
    read = _Reader(nvml)
    try:
        count = nvml.nvmlDeviceGetCount()
        gpus = tuple(_read_gpu(read, i) for i in range(count))
    except nvml.NVMLError as exc:
        raise NvmlError(f"NVML could not list the GPUs: {exc}.", hint=_REPORT_HINT) from exc
    return Inventory(
        gpus=gpus,
        driver_version=_text(read(nvml.nvmlSystemGetDriverVersion)),
        cuda_driver_version=_cuda_version(read(nvml.nvmlSystemGetCudaDriverVersion)),
        elapsed_s=time.perf_counter() - start,
        source=source,
    )


def inventory_json() -> dict[str, Any]:
    """:func:`inventory` as a JSON-able dict (with its ``schema``); raises NoDriverError."""
    return inventory().to_json()
