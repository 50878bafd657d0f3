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

What a user holds is counted from the kernel's lock table (:mod:`gpukit.sharing.flocks`): each
claimed GPU counts for the user running the process that holds its lock, whatever the lock
file's record says, and each locked file counts once, only as a GPU or MIG instance NVML
reports, however many names others give it (:func:`holdings`). Like claims themselves,
limits bind the users of gpukit; they do not stop a process that uses a GPU without claiming
it.

More limits (hours per week, per group) fit in :class:`Limits` as new keys.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from gpukit.errors import NoDriverError, NvmlError, PolicyError
from gpukit.holders import user_name
from gpukit.sharing.claims import current_claims
from gpukit.sharing.flocks import exclusive_flocks, process_uid
from gpukit.sharing.lock_folder import lock_folder
from gpukit.sharing.lockfiles import open_folder
from gpukit.untrusted import InvalidInput, open_regular, parse_toml, read_bounded

if TYPE_CHECKING:
    from gpukit.gpus.inventory import Inventory

POLICY_FILE = "policy.toml"
_MAX_POLICY_BYTES = 64 * 1024
__all__ = [
    "POLICY_FILE",
    "Limits",
    "Policy",
    "gpu_uuids",
    "holdings",
    "load_policy",
]


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
        # The layer's parser: the standard one recurses on nested arrays and inline tables.
        table = parse_toml(data, limit=_MAX_POLICY_BYTES)
    except InvalidInput as exc:
        raise PolicyError(f"Cannot read the policy {path}: {exc}.", hint=hint) from None
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
        if type(value) is not int or value < 0:  # not a bool, nor a float that looks whole
            raise PolicyError(
                f"The policy {path} sets limits.{key} = {_shown(value)}: not a whole number >= 0.",
                hint=hint,
            )
    return Limits(**limits)


def _shown(value: object) -> str:
    """A parsed TOML value as the message shows it: short, whatever the file held."""
    if type(value) in (bool, int, float, str):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a {type(value).__name__}"  # a table, an array, a date: never walked


def load_policy(folder: Path | None = None) -> Policy:
    """The policy of the lock folder ``folder`` (default: the machine's, :func:`.lock_folder`).

    No ``policy.toml`` means no limits. Raises PolicyError for an administrator's file that is
    unsafe or malformed; another user's file is ignored (see :attr:`Policy.ignored`).
    """
    folder = lock_folder() if folder is None else Path(folder)
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
        fd = open_regular(POLICY_FILE, dir_fd=folder_fd, nlink=True)
    except (OSError, InvalidInput) as exc:  # gone, or swapped for a link since the lstat
        raise PolicyError(
            f"Cannot read the policy {path}: {getattr(exc, 'strerror', None) or exc}.",
            hint="Ask an administrator.",
        ) from None
    try:
        info = os.fstat(fd)
        if (info.st_ino, info.st_dev) != (seen.st_ino, seen.st_dev):
            raise PolicyError(
                f"The policy {path} was replaced while gpukit read it.", hint="Try again."
            )
        return read_bounded(fd, _MAX_POLICY_BYTES)
    except InvalidInput:
        raise PolicyError(
            f"The policy {path} is larger than 64 KiB.", hint="Ask an administrator."
        ) from None
    except OSError as exc:
        raise PolicyError(
            f"Cannot read the policy {path}: {exc.strerror or exc}.", hint="Ask an administrator."
        ) from None
    finally:
        os.close(fd)


def holdings(
    folder: Path | None = None, gpus: Iterable[str] | None = None
) -> dict[int, tuple[str, ...]]:
    """uid -> the GPU UUIDs claimed now by processes that uid runs, from the kernel's locks.

    Only GPUs and MIG instances count: ``gpus`` are their UUIDs (default: those NVML reports,
    read only when some lock is held; every ``GPU-``/``MIG-`` name where NVML cannot be read),
    and each lock file counts once, by its inode: lock files are shared (0666), so anyone can
    add names for the one a user holds (hard links, under other ``*.lock`` names), and each
    would otherwise count as one more of that user's GPUs. An inode with several names that
    are all GPUs counts once, for the first of them.

    Where the kernel publishes no lock table, the claims' own records say who holds them.
    """
    folder = lock_folder() if folder is None else Path(folder)
    table = exclusive_flocks()
    known = None if gpus is None else frozenset(gpus)
    if table is None:
        by_name: dict[int, list[str]] = {}
        claims = current_claims(folder)
        known = _known(known, bool(claims))
        for uuid, holder in claims.items():
            if _counts(uuid, known):
                with contextlib.suppress(KeyError, TypeError):
                    by_name.setdefault(pwd.getpwnam(str(holder.user)).pw_uid, []).append(uuid)
        return {uid: tuple(sorted(uuids)) for uid, uuids in by_name.items()}
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
    names: dict[int, list[str]] = {}  # each locked inode's names, in order
    for name, inode in sorted(locks):
        if not name.startswith(".") and inode in table:
            names.setdefault(inode, []).append(name.removesuffix(".lock"))
    known = _known(known, bool(names))
    held: dict[int, list[str]] = {}
    for inode, uuids in names.items():
        # Once per inode, whatever names others gave it: as its first name that is a GPU.
        first = next((u for u in uuids if _counts(u, known)), None)
        if first is None:
            continue
        for uid in {process_uid(pid) for pid in table[inode]} - {None}:
            assert uid is not None
            held.setdefault(uid, []).append(first)
    return {uid: tuple(sorted(uuids)) for uid, uuids in held.items()}


def _known(given: frozenset[str] | None, needed: bool) -> frozenset[str] | None:
    """The UUIDs that count: ``given``, else NVML's (None: NVML cannot be read, or not needed)."""
    if given is not None or not needed:
        return given
    from gpukit.gpus.inventory import inventory

    try:
        return gpu_uuids(inventory())
    except (NoDriverError, NvmlError):
        return None


def gpu_uuids(inv: Inventory) -> frozenset[str]:
    """The UUIDs of ``inv``'s GPUs and MIG instances: what :func:`holdings` counts as GPUs.

    A caller that has just read the machine passes these as ``holdings(gpus=...)``, so that
    counting a user's GPUs does not read NVML again (the waiting loop does, every poll).
    """
    return frozenset(u for g in inv.gpus for u in (g.uuid, *(m.uuid for m in g.mig_instances)) if u)


def _counts(name: str, known: frozenset[str] | None) -> bool:
    """True when the lock file's name is one of the ``known`` GPUs (or GPU-like, unknown)."""
    return name in known if known is not None else name.startswith(("GPU-", "MIG-"))
