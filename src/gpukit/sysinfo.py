"""One report of what torch knows about this machine's devices: ``gk.system_info()``.

It gathers, in one place, the ``torch.cuda`` queries that tutorials show one by one
(``is_available``, ``device_count``, ``get_device_name``, ``get_device_properties``,
``mem_get_info``...), the cuDNN switches, the environment that steers device choice, and MPS.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from gpukit.devices import cuda_device_count, cuda_initialized
from gpukit.errors import check_bool

SCHEMA = "gpukit.info/1"

__all__ = ["SCHEMA", "system_info"]


def _cuda_device(index: int) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    return {
        "index": index,
        "name": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "total_memory": props.total_memory,
        "multiprocessors": props.multi_processor_count,
        "free_memory": free,
        "mem_get_info_total": total,
        "allocated": torch.cuda.memory_allocated(index),
        "reserved": torch.cuda.memory_reserved(index),
    }


def _cudnn() -> dict[str, Any]:
    cudnn = torch.backends.cudnn
    available = bool(cudnn.is_available())  # type: ignore[no-untyped-call]
    return {
        "available": available,
        "version": cudnn.version() if available else None,  # type: ignore[no-untyped-call]
        "enabled": bool(cudnn.enabled),
        "benchmark": bool(cudnn.benchmark),
        "deterministic": bool(cudnn.deterministic),
    }


def _cpu() -> dict[str, Any]:
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {
        "model": platform.processor() or platform.machine(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(affinity) if affinity is not None else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
    }


def system_info(*, cuda_details: bool = True) -> dict[str, Any]:
    """Everything torch knows about this machine's devices, as a JSON-able dict.

    ``cuda_details=False`` skips every query that starts CUDA in this process
    (``is_available``, ``mem_get_info``...), for callers that still want to set
    ``CUDA_VISIBLE_DEVICES``; ``available`` then means that NVML sees a visible GPU.
    On a machine without a GPU the CUDA part says so (``available: false``) and the rest is full.

    Args:
        cuda_details: whether to run the queries that start CUDA in this process.
    """
    check_bool("cuda_details", cuda_details)
    # torch.cuda.is_available() starts the CUDA driver, which then ignores later changes to
    # CUDA_VISIBLE_DEVICES; without the details, count through NVML as gk.device does.
    available = torch.cuda.is_available() if cuda_details else cuda_device_count() > 0
    count = cuda_device_count() if available else 0
    mps = getattr(torch.backends, "mps", None)
    info: dict[str, Any] = {
        "schema": SCHEMA,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": {
            "available": available,
            "built_with": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None),
            "device_count": count,
            "current_device": torch.cuda.current_device() if cuda_initialized() else None,
            "initialized": cuda_initialized(),
            "arch_list": torch.cuda.get_arch_list() if available else [],
            "devices": [_cuda_device(i) for i in range(count)] if cuda_details else [],
        },
        "cudnn": _cudnn(),
        "mps": {
            "built": bool(mps is not None and mps.is_built()),
            "available": bool(mps is not None and mps.is_available()),
        },
        "environment": {
            name: os.environ.get(name)
            for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUBLAS_WORKSPACE_CONFIG")
        },
        "cpu": _cpu(),
    }
    return info
