"""gpukit: the practical GPU layer for PyTorch.

>>> import gpukit as gk
>>> dev = gk.device("auto")          # cuda:0 if a GPU is visible, else mps, else cpu
>>> batch = gk.to_device({"x": [1, 2]}, dev)

Public names are loaded on first use, so ``import gpukit`` (and with it ``gpukit list`` and
``gpukit pick``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpukit.errors import (
    CheckpointError,
    ClaimError,
    CudaAlreadyInitializedError,
    DeviceError,
    DeviceMismatchError,
    DistributedError,
    ExitCode,
    GatherError,
    GpukitError,
    InvalidArgumentError,
    LockFolderError,
    MemoryProbeError,
    MixedDevicesError,
    NoDriverError,
    NoGpuAvailableError,
    NvmlError,
    ParallelError,
    PolicyError,
    ReplicaError,
    ScatterError,
    UnsafeLockFileError,
    UntrustedCheckpointError,
    UserLimitError,
    VisibleDevicesError,
    WaitTimeoutError,
    WorkerFailedError,
)

__version__ = "0.1.0"

# public name -> module that defines it; submodules map to themselves.
_EXPORTS: dict[str, str] = {
    # devices
    "device": "gpukit.devices",
    "try_gpu": "gpukit.devices",
    "try_all_gpus": "gpukit.devices",
    "placement": "gpukit.devices",
    "module_device": "gpukit.devices",
    "system_info": "gpukit.sysinfo",
    # transfer
    "to_device": "gpukit.transfer",
    "tree_map": "gpukit._tree",
    # repro
    "seed_everything": "gpukit.repro",
    "seed_worker": "gpukit.repro",
    # visible devices
    "visible_devices": "gpukit.gpus.visible",
    "set_visible_devices": "gpukit.gpus.visible",
    "physical_index": "gpukit.gpus.visible",
    # inventory and selection
    "inventory": "gpukit.gpus.inventory",
    "Inventory": "gpukit.gpus.inventory",
    "pick": "gpukit.sharing.pick",
    "claim": "gpukit.sharing.claims",
    "acquire": "gpukit.sharing.acquire",
    "GpuRequest": "gpukit.sharing.acquire",
    "acquire_request": "gpukit.sharing.acquire",
    # parallel
    "DataParallel": "gpukit.parallel.data_parallel",
    # checkpoints
    "save": "gpukit.checkpoint.api",
    "load": "gpukit.checkpoint.api",
    "clean_state_dict": "gpukit.checkpoint.api",
    "LoadReport": "gpukit.checkpoint.report",
    # training state
    "TrainingState": "gpukit.train.state",
    # memory
    "memory_report": "gpukit.memory.report",
    "track_peak": "gpukit.memory.peak",
    "free_memory": "gpukit.memory.report",
    "find_batch_size": "gpukit.memory.batch_size",
    "MemoryReport": "gpukit.memory.report",
    "PeakMemory": "gpukit.memory.peak",
    "FreedReport": "gpukit.memory.report",
    # doctor
    "check_devices": "gpukit.doctor",
    "explain_device_errors": "gpukit.doctor",
}
_SUBMODULES = {"checkpoint", "parallel", "distributed", "errors", "train"}

if TYPE_CHECKING:
    from gpukit._tree import tree_map as tree_map
    from gpukit.devices import device as device
    from gpukit.devices import module_device as module_device
    from gpukit.devices import placement as placement
    from gpukit.devices import try_all_gpus as try_all_gpus
    from gpukit.devices import try_gpu as try_gpu
    from gpukit.repro import seed_everything as seed_everything
    from gpukit.repro import seed_worker as seed_worker
    from gpukit.sysinfo import system_info as system_info
    from gpukit.transfer import to_device as to_device

__all__ = [
    "CheckpointError",
    "ClaimError",
    "CudaAlreadyInitializedError",
    "DeviceError",
    "DeviceMismatchError",
    "DistributedError",
    "ExitCode",
    "GatherError",
    "GpukitError",
    "InvalidArgumentError",
    "LockFolderError",
    "MemoryProbeError",
    "MixedDevicesError",
    "NoDriverError",
    "NoGpuAvailableError",
    "UnsafeLockFileError",
    "NvmlError",
    "PolicyError",
    "ParallelError",
    "ReplicaError",
    "ScatterError",
    "UntrustedCheckpointError",
    "UserLimitError",
    "VisibleDevicesError",
    "WaitTimeoutError",
    "WorkerFailedError",
    "__version__",
    *sorted(_EXPORTS),
    *sorted(_SUBMODULES),
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        module = importlib.import_module(f"gpukit.{name}")
        globals()[name] = module
        return module
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'gpukit' has no attribute {name!r}")
    value = getattr(importlib.import_module(target), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
