"""CUDA_VISIBLE_DEVICES done right: parse it as CUDA does, map CUDA's indices to real GPUs.

>>> import gpukit as gk
>>> gk.set_visible_devices([2, 3])       # before anything starts CUDA in this process
'2,3'
>>> gk.physical_index(0)                 # doctest: +SKIP
2

CUDA numbers the GPUs it is allowed to see from 0, in the order of CUDA_VISIBLE_DEVICES; the
integers in that variable count in CUDA's own order, which is *fastest first* unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, while nvidia-smi and NVML count in PCI order. On a machine
whose GPUs differ, the two disagree, and the "GPU 0" of a training script is not nvidia-smi's
GPU 0. This module says so instead of guessing silently.

Nothing here imports torch: whether CUDA has started is asked of the CUDA driver library, and
of torch only when the program has already imported it.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from gpukit.errors import (
    CudaAlreadyInitializedError,
    InvalidArgumentError,
    NoDriverError,
    VisibleDevicesError,
)

if TYPE_CHECKING:
    from gpukit.gpus.inventory import GPU, Inventory

VAR = "CUDA_VISIBLE_DEVICES"
ORDER_VAR = "CUDA_DEVICE_ORDER"

Entry = int | str


@dataclass(frozen=True)
class VisibleDevice:
    """One device CUDA will show this process, and the physical GPU behind it."""

    cuda_index: int
    """What torch calls it: ``cuda:<cuda_index>``."""
    nvml_index: int
    """What nvidia-smi calls the physical GPU (for a MIG instance: its parent GPU)."""
    uuid: str
    name: str
    mig_uuid: str | None = None
    """Set when the device is a MIG instance of the GPU."""


@dataclass(frozen=True)
class VisibleDevices:
    """The parsed view of CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER for this process."""

    env: str | None
    """CUDA_VISIBLE_DEVICES as set, or ``None`` when unset (every GPU is visible)."""
    device_order: str
    """CUDA_DEVICE_ORDER, ``'FASTEST_FIRST'`` (CUDA's default) when unset."""
    entries: tuple[Entry, ...] | None
    """The entries CUDA accepts, before matching them to GPUs; ``None`` when unset."""
    devices: tuple[VisibleDevice, ...] | None
    """The devices CUDA will number 0, 1, ...; ``None`` when NVML cannot be read."""
    warnings: tuple[str, ...] = ()
    """Why CUDA may not see what the variable seems to say."""

    @property
    def restricted(self) -> bool:
        """True when CUDA_VISIBLE_DEVICES is set."""
        return self.env is not None

    def cuda_indices(self) -> dict[int, list[int]]:
        """NVML index -> the CUDA indices of this process that run on that GPU."""
        mapping: dict[int, list[int]] = {}
        for dev in self.devices or ():
            mapping.setdefault(dev.nvml_index, []).append(dev.cuda_index)
        return mapping

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def _strtoul(text: str) -> int:
    """The leading decimal number of ``text`` (as C's strtoul reads it), or -1 if none."""
    digits = ""
    for i, ch in enumerate(text):
        if ch.isdigit() or (i == 0 and ch in "+-"):
            digits += ch
        else:
            break
    try:
        return int(digits)
    except ValueError:
        return -1


def parse_visible_devices(value: str | None) -> tuple[Entry, ...] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it, before matching entries to GPUs.

    ``None`` (unset) means every GPU; ``""`` means none. The first entry that is not of the
    first entry's kind (index, ``GPU-`` or ``MIG-`` UUID) or not valid ends the list, as in CUDA;
    a repeated entry makes CUDA see no device at all.

    >>> parse_visible_devices("1,0,x,3")
    (1, 0)
    >>> parse_visible_devices("0,0")
    ()
    """
    if value is None:
        return None
    items = [item.strip() for item in value.split(",")]
    entries: list[Entry] = []
    prefix = next((p for p in ("GPU-", "MIG-") if items[0].startswith(p)), None)
    for item in items:
        entry: Entry
        if prefix is not None:
            if not item.startswith(prefix):
                break
            entry = item
        else:
            # CUDA reads each index like strtoul, so "1gpu" is 1; a negative number ends the list.
            entry = _strtoul(item)
            if entry < 0:
                break
        if entry in entries:
            return ()
        entries.append(entry)
    return tuple(entries)


def gpus_differ(gpus: Iterable[GPU]) -> bool:
    """True when the readable GPUs are not all one model: CUDA's order may then differ."""
    # A GPU NVML cannot read tells nothing about how CUDA would order it.
    return len({(g.name, g.compute_capability) for g in gpus if g.error is None}) > 1


def cuda_order(inv: Inventory, device_order: str | None = None) -> list[GPU]:
    """The GPUs in the order CUDA enumerates them when CUDA_VISIBLE_DEVICES is unset.

    With ``PCI_BUS_ID`` this is exact (nvidia-smi's order). Otherwise CUDA puts the fastest
    GPU first by a heuristic it does not publish; gpukit's estimate sorts by compute capability,
    then by memory, keeping PCI order among equals. It is exact when the GPUs are all alike.
    """
    order = device_order or os.environ.get(ORDER_VAR, "FASTEST_FIRST")
    gpus = sorted(inv.gpus, key=lambda g: g.pci_bus_id or f"{g.index:08d}")
    if order == "PCI_BUS_ID" or not gpus_differ(gpus):
        return gpus
    return sorted(
        gpus, key=lambda g: (g.compute_capability or (0, 0), g.memory_total or 0), reverse=True
    )


def _match(entry: Entry, order: list[GPU]) -> VisibleDevice | str:
    """The device an entry names, or why CUDA will stop at it."""
    if isinstance(entry, int):
        if entry >= len(order):
            return f"index {entry} is not a GPU here ({len(order)} GPUs)"
        gpu = order[entry]
        return VisibleDevice(0, gpu.index, gpu.uuid, gpu.name)
    if entry.startswith("GPU-"):
        found = [g for g in order if g.uuid.startswith(entry)]
        if len(found) != 1:
            return f"{entry} matches {len(found)} GPUs"
        return VisibleDevice(0, found[0].index, found[0].uuid, found[0].name)
    migs = [(g, m) for g in order for m in g.mig_instances if m.uuid.startswith(entry)]
    if len(migs) != 1:
        return f"{entry} matches {len(migs)} MIG instances"
    gpu, mig = migs[0]
    return VisibleDevice(0, gpu.index, gpu.uuid, mig.name or gpu.name, mig.uuid)


def resolve(env: str | None, device_order: str | None, inv: Inventory | None) -> VisibleDevices:
    """The view of given CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER values on ``inv``'s machine."""
    order_name = device_order or "FASTEST_FIRST"
    entries = parse_visible_devices(env)
    warnings: list[str] = []
    if env is not None and entries is not None and len(entries) < len(env.split(",")):
        if entries == () and env.strip():
            warnings.append(f"{VAR}={env} repeats or starts with an invalid entry: no GPU is seen.")
        elif entries:
            warnings.append(
                f"{VAR}={env}: CUDA stops at the first invalid entry and uses only "
                f"{','.join(map(str, entries))}."
            )
    if inv is None:
        return VisibleDevices(env, order_name, entries, None, tuple(warnings))
    order = cuda_order(inv, order_name)
    if (
        order_name != "PCI_BUS_ID"
        and gpus_differ(order)
        and (entries is None or any(isinstance(e, int) for e in entries))
    ):
        guess = ", ".join(f"cuda:{i}=GPU {g.index} ({g.name})" for i, g in enumerate(order))
        warnings.append(
            f"{ORDER_VAR} is not PCI_BUS_ID and this machine's GPUs differ, so CUDA's numbering "
            f"may differ from nvidia-smi's (likely {guess}). Set {ORDER_VAR}=PCI_BUS_ID to make "
            "them agree."
        )
    devices: list[VisibleDevice] = []
    wanted: Iterable[Entry] = range(len(order)) if entries is None else entries
    for entry in wanted:
        found = _match(entry, order)
        if isinstance(found, str):
            warnings.append(f"{VAR}={env}: {found}, so CUDA ignores it and every entry after it.")
            break
        if any(d.uuid == found.uuid and d.mig_uuid == found.mig_uuid for d in devices):
            warnings.append(f"{VAR}={env} names one device twice: CUDA sees no GPU.")
            devices = []
            break
        devices.append(
            VisibleDevice(len(devices), found.nvml_index, found.uuid, found.name, found.mig_uuid)
        )
    return VisibleDevices(env, order_name, entries, tuple(devices), tuple(warnings))


def visible_devices(inventory: Inventory | None = None) -> VisibleDevices:
    """What CUDA will show this process, matched to the machine's GPUs (read from NVML).

    Without an NVIDIA driver, ``devices`` is ``None`` and only the parsed entries are given.

    Args:
        inventory: the machine's GPUs already read; None: read them now.

    Raises:
        NvmlError: NVML started but could not read the GPUs.
        InvalidArgumentError: ``GPUKIT_FAKE_NVML`` names a machine description gpukit refuses.
    """
    if inventory is None:
        from gpukit.gpus.inventory import inventory as read_inventory

        try:
            inventory = read_inventory()
        except NoDriverError:
            inventory = None
    return resolve(os.environ.get(VAR), os.environ.get(ORDER_VAR), inventory)


def physical_index(i: int, inventory: Inventory | None = None) -> int:
    """The NVML (nvidia-smi) index of the GPU this process calls ``cuda:i``.

    For a MIG instance, the index of the GPU it belongs to.

    Args:
        i: the CUDA index in this process (``cuda:i``).
        inventory: the machine's GPUs already read; None: read them now.

    Raises:
        InvalidArgumentError: ``i`` is not a whole number.
        VisibleDevicesError: this process sees no ``cuda:i`` (the message lists what it sees).
        NoDriverError: no NVIDIA driver or NVML to map it with (exit 3).
    """
    from gpukit.gpus.inventory import inventory as read_inventory

    if isinstance(i, bool) or not isinstance(i, int):
        raise InvalidArgumentError(
            f"physical_index({i!r}): a CUDA index is a whole number.",
            hint="Pass 0 for cuda:0, 1 for cuda:1, and so on.",
        )
    view = visible_devices(inventory or read_inventory())
    devices = view.devices or ()
    if not 0 <= i < len(devices):
        seen = ", ".join(f"cuda:{d.cuda_index}=GPU {d.nvml_index}" for d in devices) or "none"
        env = f"{VAR}={view.env}" if view.restricted else f"{VAR} is not set"
        raise VisibleDevicesError(
            f"cuda:{i} is not visible: this process sees {len(devices)} CUDA devices "
            f"({seen}; {env}).",
            hint="Use one of those indices, or change CUDA_VISIBLE_DEVICES before CUDA starts.",
        )
    return devices[i].nvml_index


_CUDA_ERROR_NOT_INITIALIZED = 3
_DRIVER_LIBRARY = "libcuda.so.1"


def _loaded_cuda_driver() -> Any:
    """The CUDA driver library if this process has already loaded it, else ``None``.

    Never loads it: ``RTLD_NOLOAD`` only finds a library that is already there.
    """
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:  # not Linux: CUDA's driver is not a shared object found this way
        return None
    try:
        return ctypes.CDLL(_DRIVER_LIBRARY, mode=noload | os.RTLD_LAZY)
    except OSError:
        return None


def _driver_started() -> bool:
    """Whether the CUDA driver has been initialised (``cuInit``) in this process, by any route.

    ``torch.cuda.is_available()`` and ``device_count()`` start the driver through
    ``cudaGetDeviceCount`` while ``torch.cuda.is_initialized()`` stays False, and the driver reads
    CUDA_VISIBLE_DEVICES only then. ``cuDeviceGetCount`` answers CUDA_ERROR_NOT_INITIALIZED until
    ``cuInit`` ran, and starts nothing itself; any other answer (a count, or the error that
    ``cuInit`` met) means the driver has read the variable already.
    """
    driver = _loaded_cuda_driver()
    if driver is None:  # the driver is not even loaded, so nothing has started it
        return False
    count = ctypes.c_int(0)
    return int(driver.cuDeviceGetCount(ctypes.byref(count))) != _CUDA_ERROR_NOT_INITIALIZED


def cuda_started(*, by_torch: bool = False) -> bool:
    """Whether CUDA has started in this process: gpukit's one answer. Never starts it, and never
    imports torch (a program that has not imported torch cannot have started CUDA through it).

    By default, started by any route: torch has set CUDA up (``torch.cuda.is_initialized()``),
    or the CUDA driver has been initialised, as ``torch.cuda.is_available()`` and
    ``device_count()`` do while ``is_initialized()`` stays False. From then on the driver has
    read CUDA_VISIBLE_DEVICES, so :func:`set_visible_devices` refuses to change it.

    ``by_torch=True`` asks the narrower question: has torch set CUDA up, so that calling
    ``torch.cuda.current_device()`` or ``get_rng_state_all()`` starts nothing new. Whatever
    torch has set up, the driver has started too, so a True here is a True by default.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    return False if by_torch else _driver_started()


def _as_entry(item: object) -> Entry:
    uuid = getattr(item, "uuid", None)  # a GPU or MIG instance from gk.inventory()
    if isinstance(uuid, str):
        return uuid
    if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
        return item
    if isinstance(item, str):
        text = item.strip()
        if text.isdigit():
            return int(text)
        if text.startswith(("GPU-", "MIG-")):
            return text
    raise VisibleDevicesError(
        f"Cannot make {item!r} visible: not a GPU index, GPU- or MIG- UUID, or GPU.",
        hint="Pass NVML indices (as in `gpukit list`), UUIDs, or GPUs from gk.inventory().",
    )


def set_visible_devices(ids: Iterable[object] | int | str) -> str:
    """Make only ``ids`` visible to CUDA in this process, numbered in PCI (nvidia-smi) order.

    Sets CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER=PCI_BUS_ID, so integer ids mean what
    nvidia-smi shows. Returns the value set.

    >>> set_visible_devices("GPU-6513270e")       # a UUID, or a unique prefix of one
    'GPU-6513270e'

    Args:
        ids: NVML indices, GPU- or MIG- UUIDs, or GPUs from :func:`gpukit.inventory`: one
            int, a comma-separated string, or an iterable of them.

    Raises:
        CudaAlreadyInitializedError: the CUDA driver has started in this process, by any
            route (``torch.cuda.is_available()`` starts it while ``torch.cuda.is_initialized()``
            stays False), so CUDA would silently ignore the change.
        VisibleDevicesError: an id is no GPU index, UUID or GPU, one is listed twice, or
            indices and UUIDs are mixed (CUDA would ignore part of the list).
    """
    if isinstance(ids, (int, str)):
        items: list[object] = [p for p in str(ids).split(",") if p.strip()]
    else:
        items = list(ids)
    entries = [_as_entry(item) for item in items]
    value = ",".join(str(e) for e in entries)
    if len(set(entries)) != len(entries):
        raise VisibleDevicesError(
            f"Cannot set {VAR}={value}: it names a device twice, and CUDA would then see none.",
            hint="List each GPU once.",
        )
    kinds = {"int" if isinstance(e, int) else e[:4] for e in entries}
    if len(kinds) > 1:
        raise VisibleDevicesError(
            f"Cannot set {VAR}={value}: CUDA stops at the first entry of another kind than the "
            "first, so it would ignore part of it.",
            hint="Use only indices, only GPU- UUIDs, or only MIG- UUIDs.",
        )
    current = (os.environ.get(VAR), os.environ.get(ORDER_VAR))
    if current != (value, "PCI_BUS_ID") and cuda_started():
        raise CudaAlreadyInitializedError(
            f"Cannot set {VAR}={value}: CUDA has already started in this process (with "
            f"{VAR}={current[0]}), so the change would be silently ignored.",
            hint="Set it before the first CUDA call (torch.cuda.is_available() is one; "
            "gk.device and gk.try_gpu are not), or start a new process with it, e.g. "
            f"`gpukit run` or `{VAR}={value} python train.py`.",
        )
    os.environ[ORDER_VAR] = "PCI_BUS_ID"
    os.environ[VAR] = value
    return value
