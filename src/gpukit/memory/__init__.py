"""Memory: what a device holds and who holds it, the peak of a block, freeing, batch sizes.

``report`` builds memory reports and frees objects; ``peak`` tracks the peak of a block;
``batch_size`` finds the largest batch that fits; ``stats`` reads the allocator and the process.
"""

from gpukit.memory.batch_size import find_batch_size, is_out_of_memory
from gpukit.memory.peak import PeakMemory, track_peak
from gpukit.memory.report import FreedReport, MemoryReport, TensorInfo, free_memory, memory_report

__all__ = [
    "FreedReport",
    "MemoryReport",
    "PeakMemory",
    "TensorInfo",
    "find_batch_size",
    "free_memory",
    "is_out_of_memory",
    "memory_report",
    "track_peak",
]
