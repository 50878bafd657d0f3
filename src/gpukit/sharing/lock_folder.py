"""Where the lock folder is: one per machine, whatever each user's environment says.

Claims only keep two jobs off one GPU when every gpukit process on the machine uses the same
folder, so the location never depends on per-user settings such as ``TMPDIR``. In order:

1. ``GPUKIT_LOCK_DIR``, an explicit override for one process (tests, or a group of users that
   agrees on its own folder). ``gpukit list`` and ``gpukit info`` warn when it differs from the
   machine's folder, since claims in one folder are invisible from the other.
2. ``lock_folder`` in the machine's config file, ``/etc/gpukit/config.toml`` (``GPUKIT_CONFIG``
   names another file), which ``sudo gpukit setup-locks`` writes::

       lock_dir = "/var/lib/gpukit/locks"

3. :data:`DEFAULT_LOCK_FOLDER`, ``/tmp/gpukit-locks``: no setup needed, created on first use,
   shared by every user (mode 1777), and held to the trust model of :mod:`.lockfiles`.

The config file is trusted only when root or the current user owns it and nobody else can
write it: otherwise anyone could point everyone's claims at a folder of their choosing.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpukit.errors import LockFolderError
from gpukit.holders import user_name
from gpukit.untrusted import InvalidInput, open_regular, parse_toml, read_bounded

LOCK_FOLDER_VAR = "GPUKIT_LOCK_DIR"
CONFIG_VAR = "GPUKIT_CONFIG"
DEFAULT_CONFIG = Path("/etc/gpukit/config.toml")
DEFAULT_LOCK_FOLDER = Path("/tmp/gpukit-locks")
"""Fixed, not ``tempfile.gettempdir()``: ``TMPDIR`` differs between users and jobs."""
ADMIN_LOCK_FOLDER = Path("/var/lib/gpukit/locks")
"""Where ``gpukit setup-locks`` puts a lock folder only root controls."""
_MAX_CONFIG_BYTES = 1024 * 1024


@dataclass(frozen=True)
class LockFolderChoice:
    """The lock folder this process uses, where that choice comes from, and the machine's."""

    path: Path
    source: str
    """``'GPUKIT_LOCK_DIR'``, the config file's path, or ``'default'``."""
    machine: Path
    """The machine's folder (config file or default), which other users' gpukit uses."""
    machine_source: str

    @property
    def overridden(self) -> bool:
        """True when this process uses another folder than the machine's."""
        return os.path.realpath(self.path) != os.path.realpath(self.machine)

    @property
    def warning(self) -> str | None:
        """What goes wrong with an override that differs from the machine's folder."""
        if not self.overridden:
            return None
        return (
            f"{LOCK_FOLDER_VAR}={self.path} is not this machine's lock folder {self.machine} "
            f"({self.machine_source}): claims made here are invisible to gpukit processes that "
            "use the machine's folder, and theirs to this one, so two jobs can get one GPU."
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict for ``gpukit list --json`` and ``gpukit info --json``."""
        return {
            "path": str(self.path),
            "source": self.source,
            "machine": str(self.machine),
            "machine_source": self.machine_source,
            "warning": self.warning,
        }


def config_path() -> Path:
    """The machine's config file: ``GPUKIT_CONFIG``, or ``/etc/gpukit/config.toml``."""
    return Path(os.environ.get(CONFIG_VAR) or DEFAULT_CONFIG)


def _absolute(value: str, where: str) -> Path:
    if not value or not os.path.isabs(value) or "\0" in value:
        raise LockFolderError(
            f"The lock folder {value!r} given by {where} is not an absolute path: a relative "
            "one would name a different folder in each working directory.",
            hint=f"Give an absolute path in {where}.",
        )
    return Path(os.path.normpath(value))


def read_config(path: Path | None = None) -> dict[str, Any]:
    """The machine's config as a dict; ``{}`` when the file does not exist.

    Raises LockFolderError when it cannot be read or parsed, or when someone other than root and
    the current user could have written it.
    """
    path = config_path() if path is None else path
    hint = 'Fix the TOML (e.g. `lock_dir = "/var/lib/gpukit/locks"`).'
    try:
        # Followed if a link (an administrator's choice of where the file lives), never
        # blocking on a FIFO, checked to be a regular file before it is read.
        fd = open_regular(path, follow=True)
    except FileNotFoundError:
        return {}
    except InvalidInput as exc:
        raise LockFolderError(
            f"The gpukit config {path} is {exc}.",
            hint=f"Make it a TOML file, or remove it (or set {CONFIG_VAR}).",
        ) from None
    except OSError as exc:
        raise LockFolderError(
            f"Cannot read the gpukit config {path}: {exc.strerror or exc}.",
            hint="An administrator should make it readable by every user (mode 644).",
        ) from exc
    try:
        info = os.fstat(fd)
        if info.st_uid not in (0, os.geteuid()) or info.st_mode & 0o022:
            raise LockFolderError(
                f"Refused the gpukit config {path}: it belongs to {user_name(info.st_uid)} "
                f"with mode {stat.S_IMODE(info.st_mode):04o}, so another user could have "
                "written it.",
                hint=f"An administrator should make it root's and not writable by others "
                f"(`sudo chown root {path}; sudo chmod 644 {path}`).",
            )
        return parse_toml(read_bounded(fd, _MAX_CONFIG_BYTES), limit=_MAX_CONFIG_BYTES)
    except InvalidInput as exc:
        raise LockFolderError(f"Cannot read the gpukit config {path}: {exc}.", hint=hint) from None
    except OSError as exc:
        raise LockFolderError(
            f"Cannot read the gpukit config {path}: {exc.strerror or exc}.",
            hint="An administrator should make it readable by every user (mode 644).",
        ) from exc
    finally:
        os.close(fd)


def machine_lock_folder() -> tuple[Path, str]:
    """The machine's lock folder and where it comes from (the config file, or ``'default'``)."""
    path = config_path()
    value = read_config(path).get("lock_dir")
    if value is None:
        return DEFAULT_LOCK_FOLDER, "default"
    if not isinstance(value, str):
        raise LockFolderError(
            f"lock_dir in {path} is {value!r}, not a path in quotes.",
            hint=f'Write it as `lock_dir = "{ADMIN_LOCK_FOLDER}"`.',
        )
    return _absolute(value, f"lock_dir in {path}"), str(path)


def lock_folder_choice() -> LockFolderChoice:
    """Which lock folder this process uses and why (see the module docstring for the order)."""
    machine, machine_source = machine_lock_folder()
    override = os.environ.get(LOCK_FOLDER_VAR)
    if override:
        path = _absolute(override, LOCK_FOLDER_VAR)
        return LockFolderChoice(path, LOCK_FOLDER_VAR, machine, machine_source)
    return LockFolderChoice(machine, machine_source, machine, machine_source)


def lock_folder() -> Path:
    """The lock folder this process uses: ``GPUKIT_LOCK_DIR``, the config's, or the default.

    An override is used without reading the config file (only the warning needs it).
    """
    override = os.environ.get(LOCK_FOLDER_VAR)
    if override:
        return _absolute(override, LOCK_FOLDER_VAR)
    return machine_lock_folder()[0]
