"""The gpukit exception hierarchy.

Every error says three things: what was asked, what is true, and what to do next. The library
raises these and never prints; the command line turns them into one sentence on stderr and the
exit code in :attr:`GpukitError.exit_code` (documented in the README, stable across releases).

This module must not import torch: the command line imports it on every start.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NoReturn


class ExitCode(IntEnum):
    """Exit codes of the ``gpukit`` command. Stable: scripts rely on them."""

    OK = 0
    INTERNAL = 1
    USAGE = 2
    NO_DRIVER = 3
    NO_GPU = 4
    LOCK_FOLDER = 5
    TIMEOUT = 124


class GpukitError(Exception):
    """Base class of every error gpukit raises on purpose.

    ``message`` states what was asked and what is true; ``hint`` says what to do next. ``str()``
    gives both, as one paragraph.

    Args:
        message: what was asked and what is true, one or more sentences.
        hint: what to do next; None: no hint.
    """

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message} {hint}" if hint else message)


class InvalidArgumentError(GpukitError, ValueError):
    """An argument that makes no sense (a negative size, an unknown option value...)."""

    exit_code = ExitCode.USAGE


class DeviceError(GpukitError, ValueError):
    """A device that does not exist, is not visible, or cannot be used here."""

    exit_code = ExitCode.USAGE


class MixedDevicesError(DeviceError):
    """A module's parameters and buffers sit on more than one device."""


class DeviceMismatchError(DeviceError):
    """The tensors a computation needs are on different devices."""


class VisibleDevicesError(GpukitError, ValueError):
    """A CUDA_VISIBLE_DEVICES value or request that cannot be honoured."""

    exit_code = ExitCode.USAGE


class CudaAlreadyInitializedError(GpukitError, RuntimeError):
    """CUDA has started in this process, so CUDA_VISIBLE_DEVICES can no longer take effect."""


class NoDriverError(GpukitError, RuntimeError):
    """No NVIDIA driver or NVML library on this machine."""

    exit_code = ExitCode.NO_DRIVER


class NvmlError(GpukitError, RuntimeError):
    """NVML answered with an error that gpukit cannot turn into a 'not available' reading."""


class NoGpuAvailableError(GpukitError, RuntimeError):
    """Fewer GPUs than asked for satisfy the criteria."""

    exit_code = ExitCode.NO_GPU


class ClaimError(GpukitError, RuntimeError):
    """A GPU could not be claimed because another process holds it."""

    exit_code = ExitCode.NO_GPU


class LockFolderError(GpukitError, RuntimeError):
    """The lock folder cannot be used: it cannot be created or written, or gpukit refuses it.

    Refused means that it does not fit the lock folder's trust model (README, "Security"): a
    link in place of the folder, a folder another user owns that is not shared the way gpukit
    shares it, or a configured location that is not an absolute path.
    """

    exit_code = ExitCode.LOCK_FOLDER


class UnsafeLockFileError(LockFolderError):
    """A file in the lock folder that gpukit refuses to open for writing.

    A symbolic or hard link (possibly to one of your files), a FIFO, a device or a folder where
    a lock file should be: gpukit never writes, truncates or waits on such a thing.
    """


class WaitTimeoutError(GpukitError, TimeoutError):
    """Waited past the timeout for GPUs to become free."""

    exit_code = ExitCode.TIMEOUT


class ParallelError(GpukitError, RuntimeError):
    """Base class of the single-process data-parallel errors."""


class ScatterError(ParallelError, ValueError):
    """A batch that cannot be split across devices (sizes that disagree along the split dim)."""

    exit_code = ExitCode.USAGE


class ReplicaError(ParallelError):
    """A replica failed during ``parallel_apply``; the original exception is ``__cause__``."""


class GatherError(ParallelError):
    """Replica outputs whose structures disagree and so cannot be gathered."""


class CheckpointError(GpukitError, RuntimeError):
    """A checkpoint that cannot be read, written, or loaded into the given model."""

    # A truncated, foreign or mismatched file is bad input, not a bug in gpukit.
    exit_code = ExitCode.USAGE


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint that holds pickled code, refused because the caller did not trust it."""


class DistributedError(GpukitError, RuntimeError):
    """torch.distributed misuse or failure: bad environment, failed worker, wrong backend."""


class WorkerFailedError(DistributedError):
    """One or more worker processes of a launch failed; names the rank and its error."""


class MemoryProbeError(GpukitError, RuntimeError):
    """The batch-size finder found no size that fits, or memory readings failed."""


class UserLimitError(NoGpuAvailableError):
    """A claim refused because it would take a user past a limit of the lock folder's policy."""


class PolicyError(LockFolderError):
    """The administrator's policy file (``policy.toml`` in the lock folder) cannot be used.

    Unsafe (writable by users other than the administrator) or malformed: gpukit refuses to
    guess what limits were meant, so nothing is claimed until it is fixed.
    """


def _refuse_switch(name: str, value: object, allowed: str) -> NoReturn:
    raise InvalidArgumentError(
        f"{name}={value!r} (a {type(value).__name__}) is not {allowed}.",
        hint=f"Pass {name}=True or {name}=False: any other value is refused, because a string "
        'such as "no" or "false" would otherwise count as true.',
    )


def check_bool(name: str, value: object, *, allow_none: bool = False) -> None:
    """Refuse anything but ``True`` or ``False`` (and ``None`` with ``allow_none``) for a switch.

    Python treats any non-empty string as true, so ``load(model, path, trust="no")`` would
    trust the file; gpukit's switches accept real booleans only.

    >>> check_bool("trust", "no")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    gpukit.errors.InvalidArgumentError: trust='no' (a str) is not True or False. ...
    """
    if value is True or value is False or (allow_none and value is None):
        return
    _refuse_switch(name, value, "True, False or None" if allow_none else "True or False")
