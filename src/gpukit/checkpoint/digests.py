"""The digests of a training state's files, and reading a save's folder as a checkpoint.

Each save of :class:`gpukit.TrainingState` names every file it wrote in its marker,
``COMPLETE.json``, with the file's XXH3-128 digest (:func:`digest`, through ``xxhash``). The
training state verifies them before it resumes a save; :func:`verified_save` does the same
for ``gk.load(model, save_folder)``, so that a save whose bytes changed since it was written is
refused whichever door it is opened through.

XXH3 is a check against accidents (a flipped bit, a file cut short and rewritten, a copy gone
wrong), many times faster than any disk: it is no defence against someone who can write the
save, who could rewrite its marker too. The training state's ownership rules are that defence.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

import xxhash

from gpukit import untrusted
from gpukit.errors import CheckpointError

__all__ = ["MARKER", "digest", "is_save_folder", "verified_save"]

MARKER = "COMPLETE.json"
SHARED = "shared.pt"
_MARKER_LIMIT = 1 << 20
# The files a save's marker may name: never a path out of the save.
_FILE = re.compile(
    r"^(?:shared\.pt|rank-[0-9]{5,9}\.pt|sharded/(?:\.metadata|__[0-9]{1,9}_0\.distcp))$",
    re.ASCII,
)
_DIGEST = re.compile(r"^[0-9a-f]{32}$", re.ASCII)


def digest(path: Path) -> str:
    """The XXH3-128 digest of the file at ``path`` (hex), read through a memory map.

    Opened as a file others may have changed is: not through a link, not blocking on a FIFO,
    a regular file only.

    Raises:
        OSError: the file cannot be opened or read.
        untrusted.InvalidInput: ``path`` is a link or not a regular file.
    """
    fd = untrusted.open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return xxhash.xxh3_128_hexdigest(b"")
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as view:
            return xxhash.xxh3_128_hexdigest(view)
    finally:
        os.close(fd)


def is_save_folder(names: list[str]) -> bool:
    """Whether a folder holding ``names`` is a training state's save (its marker, its shared
    part)."""
    return MARKER in names and SHARED in names


def verified_save(folder: Path) -> dict[str, str]:
    """Check every file a save's marker names against its digest; return the digests.

    Raises:
        CheckpointError: the marker is missing, malformed or names a path outside the save, or
            a file is missing or not what was saved.
    """
    try:
        raw = untrusted.read_file(folder / MARKER, _MARKER_LIMIT)
        marker = untrusted.as_dict(untrusted.parse_json(raw, limit=_MARKER_LIMIT), what="marker")
        sums = untrusted.as_dict(marker.get("digests"), limit=1 << 16, what="its digests")
        if SHARED not in sums:
            raise untrusted.InvalidInput("its marker gives no digest of shared.pt")
        for name, expected in sums.items():
            if not _FILE.match(name) or type(expected) is not str or not _DIGEST.match(expected):
                raise untrusted.InvalidInput("its marker names a file or digest not of a save")
            if digest(folder / name) != expected:
                raise untrusted.InvalidInput(f"{name} is not what was saved (its digest differs)")
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{folder} is not a complete save: {Path(exc.filename or '?').name} is missing.",
            hint="Load another save of the run (a sibling step-... folder).",
        ) from None
    except (OSError, untrusted.InvalidInput) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise CheckpointError(
            f"{folder} is not a save gpukit can load: {reason}.",
            hint="The save changed after it was written; load another save of the run (a "
            "sibling step-... folder).",
        ) from None
    return sums
