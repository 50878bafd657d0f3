"""Single-process data parallelism: scatter a batch, replicate a module, apply, gather.

These are the four steps of ``gk.DataParallel``, each usable alone. All accept repeated CPU
devices (``["cpu"] * 4``), so multi-device code runs on machines without GPUs.
"""

from __future__ import annotations

from gpukit.parallel.apply import parallel_apply
from gpukit.parallel.data_parallel import DataParallel
from gpukit.parallel.gather import gather
from gpukit.parallel.replicate import replicate
from gpukit.parallel.scatter import chunk_sizes, scatter

__all__ = ["DataParallel", "chunk_sizes", "gather", "parallel_apply", "replicate", "scatter"]
