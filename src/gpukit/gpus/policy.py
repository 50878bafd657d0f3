"""Per-user limits that the administrator of a shared server sets in the lock folder.

An administrator puts ``policy.toml`` in the lock folder::

    [limits]
    max_gpus_per_user = 2

and from then on a claim through gpukit (``gpukit run``, :func:`gpukit.acquire`, and
:func:`gpukit.pick`, which chooses for one) that would take a user past the limit is refused
with :class:`~gpukit.errors.UserLimitError` (exit 4), naming the limit and what the user holds;
a waiter (``--wait``) waits until its user's own claims drop, without holding up the waiters
behind it.

Who may set the policy. The administrator is root or the owner of the lock folder (who can
deny every GPU anyway). Their file must belong to them and must not be writable by group or
others, else it is refused with :class:`~gpukit.errors.PolicyError`; a file of theirs that is
malformed (unknown keys, wrong types) is refused too, rather than guessed at. A
``policy.toml`` that belongs to anyone else is *not a policy*: in a folder every user can add
files to, honouring it would let any co-user stop every claim, so it is ignored and
:attr:`Policy.ignored` says why (``gpukit run`` prints it).

What a user holds is counted from the kernel's lock table (:mod:`gpukit.gpus.flocks`): each
claimed GPU counts for the user running the process that holds its lock, whatever the lock
file's record says. Like claims themselves, limits bind the users of gpukit; they do not stop
a process that uses a GPU without claiming it.

More limits (hours per week, per group) fit in :class:`Limits` as new keys.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gpukit.errors import LockFolderError, PolicyError
from gpukit.gpus.claims import current_claims, lock_dir
from gpukit.gpus.flocks import exclusive_flocks, process_uid
from gpukit.gpus.lockfiles import open_folder, open_lock_file
from gpukit.gpus.lockfiles import owner_name as user_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the same parser, before it joined the standard library
    import tomli as tomllib

POLICY_FILE = "policy.toml"
_MAX_POLICY_BYTES = 64 * 1024
__all__ = ["POLICY_FILE", "Limits", "Policy", "holdings", "load_policy", "user_name"]


@dataclass(frozen=True)
class Limits:
    """The ``[limits]`` table of ``policy.toml``; ``None`` means no limit."""

    max_gpus_per_user: int | None = None
    """How many GPUs one user may hold through gpukit claims at once."""


@dataclass(frozen=True)
class Policy:
    """The limits in force for the lock folder, and where they come from."""

    limits: Limits = field(default_factory=Limits)
    path: Path | None = None
    """The policy file read, or ``None`` when there is none (no limits)."""
    ignored: str | None = None
    """Why a ``policy.toml`` that was found is not applied (it is not the administrator's)."""

    def refusal(self, uid: int, n: int, holdings: Mapping[int, tuple[str, ...]]) -> str | None:
        """Why user ``uid`` may not take ``n`` more GPUs now, or ``None`` when they may.

        ``holdings`` maps a uid to the GPUs its processes hold (:func:`holdings`).
        """
        limit = self.limits.max_gpus_per_user
        if limit is None:
            return None
        held = len(holdings.get(uid, ()))
        if held + n <= limit:
            return None
        return f"user limit {limit} reached" if held else f"user limit {limit} is below {n}"

    def explain(self, uid: int, n: int, holdings: Mapping[int, tuple[str, ...]]) -> str:
        """A sentence for the error: the limit, where it is set, and what the user holds."""
        limit = self.limits.max_gpus_per_user
        held = holdings.get(uid, ())
        what = f"{len(held)} ({', '.join(held)})" if held else "none"
        return (
            f"Asked for {n} GPU{'s' if n != 1 else ''}, but the policy {self.path} allows "
            f"{limit} per user (max_gpus_per_user) and {user_name(uid)} already holds {what}."
        )

    def could_ever_allow(self, n: int) -> bool:
        """False when no amount of waiting lets one user take ``n`` GPUs."""
        limit = self.limits.max_gpus_per_user
        return limit is None or n <= limit


def _admin_uids(folder_fd: int) -> tuple[int, ...]:
    return (0, os.fstat(folder_fd).st_uid)


def _parse(data: bytes, path: Path) -> Limits:
    hint = f"Fix {path}: it holds one table, [limits], e.g. max_gpus_per_user = 2."
    try:
        table: dict[str, Any] = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PolicyError(f"Cannot read the policy {path}: {exc}.", hint=hint) from exc
    unknown = sorted(set(table) - {"limits"})
    limits = table.get("limits", {})
    if not isinstance(limits, dict):
        raise PolicyError(f"The policy {path}: limits is not a table.", hint=hint)
    known = {f.name for f in fields(Limits)}
    unknown += [f"limits.{key}" for key in sorted(set(limits) - known)]
    if unknown:
        raise PolicyError(
            f"The policy {path} sets {', '.join(unknown)}, which gpukit does not know: refused "
            "rather than guess what was meant.",
            hint=f"Known limits: {', '.join(sorted(known))}. {hint}",
        )
    for key, value in limits.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PolicyError(
                f"The policy {path} sets limits.{key} = {value!r}: not a whole number >= 0.",
                hint=hint,
            )
    return Limits(**limits)


def load_policy(folder: Path | None = None) -> Policy:
    """The policy of the lock folder ``folder`` (default: :func:`~gpukit.gpus.claims.lock_dir`).

    No ``policy.toml`` means no limits. Raises PolicyError for an administrator's file that is
    unsafe or malformed; another user's file is ignored (see :attr:`Policy.ignored`).
    """
    folder = lock_dir() if folder is None else Path(folder)
    if not os.path.lexists(folder):
        return Policy()  # no lock folder yet: no one has set a policy in it
    folder_fd = open_folder(folder)
    try:
        return _load(folder_fd, folder / POLICY_FILE)
    finally:
        os.close(folder_fd)


def _load(folder_fd: int, path: Path) -> Policy:
    try:
        info = os.lstat(POLICY_FILE, dir_fd=folder_fd)
    except FileNotFoundError:
        return Policy()
    except OSError as exc:
        raise PolicyError(
            f"Cannot read the policy {path}: {exc.strerror}.", hint="Ask an administrator."
        ) from exc
    admins = _admin_uids(folder_fd)
    if info.st_uid not in admins:
        return Policy(
            path=path,
            ignored=f"{path} belongs to {user_name(info.st_uid)}, not to root or the lock "
            f"folder's owner ({user_name(admins[1])}): it is not a policy and sets no limit.",
        )
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or mode & 0o022:
        what = (
            f"writable by others (mode {mode:04o})"
            if stat.S_ISREG(info.st_mode)
            else "not a plain file"
        )
        if stat.S_ISREG(info.st_mode) and info.st_nlink != 1:
            what = f"a file with {info.st_nlink} hard links"
        raise PolicyError(
            f"Refused the policy {path}: it is {what}, so someone other than the administrator "
            "could have set its limits.",
            hint=f"The administrator can make it a plain file only they can write: "
            f"chmod go-w {path}.",
        )
    return Policy(limits=_parse(_read(folder_fd, path, info), path), path=path)


def _read(folder_fd: int, path: Path, seen: os.stat_result) -> bytes:
    try:
        fd = open_lock_file(path.parent, POLICY_FILE, dir_fd=folder_fd)
    except (OSError, LockFolderError) as exc:  # gone, or swapped for a link since the lstat
        raise PolicyError(
            f"Cannot read the policy {path}: {getattr(exc, 'message', None) or exc}.",
            hint="Ask an administrator.",
        ) from exc
    try:
        info = os.fstat(fd)
        if (info.st_ino, info.st_dev) != (seen.st_ino, seen.st_dev):
            raise PolicyError(
                f"The policy {path} was replaced while gpukit read it.", hint="Try again."
            )
        data = os.read(fd, _MAX_POLICY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_POLICY_BYTES:
        raise PolicyError(f"The policy {path} is larger than 64 KiB.", hint="Ask an administrator.")
    return data


def holdings(folder: Path | None = None) -> dict[int, tuple[str, ...]]:
    """uid -> the GPU UUIDs claimed now by processes that uid runs, from the kernel's locks.

    Where the kernel publishes no lock table, the claims' own records say who holds them.
    """
    folder = lock_dir() if folder is None else Path(folder)
    table = exclusive_flocks()
    if table is None:
        by_name: dict[int, list[str]] = {}
        for uuid, holder in current_claims(folder).items():
            with contextlib.suppress(KeyError, TypeError):
                by_name.setdefault(pwd.getpwnam(str(holder.user)).pw_uid, []).append(uuid)
        return {uid: tuple(sorted(uuids)) for uid, uuids in by_name.items()}
    held: dict[int, list[str]] = {}
    if not os.path.lexists(folder):
        return {}
    folder_fd = open_folder(folder)
    try:
        with os.scandir(folder_fd) as entries:
            locks = [(e.name, e.inode()) for e in entries if e.name.endswith(".lock")]
    except OSError:
        return {}
    finally:
        os.close(folder_fd)
    for name, inode in locks:
        if name.startswith("."):
            continue
        for uid in {process_uid(pid) for pid in table.get(inode, ())} - {None}:
            assert uid is not None
            held.setdefault(uid, []).append(name.removesuffix(".lock"))
    return {uid: tuple(sorted(uuids)) for uid, uuids in held.items()}
