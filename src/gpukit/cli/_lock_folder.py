"""Which lock folder is in use, for ``gpukit list`` and ``gpukit info``: shown, and warned about.

A process whose ``GPUKIT_LOCK_DIR`` differs from the machine's lock folder does not see the
claims of other users (nor they its own), so both commands say so instead of looking normal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpukit.errors import LockFolderError

if TYPE_CHECKING:
    from gpukit.holders import Holder
    from gpukit.sharing.lock_folder import LockFolderChoice


@dataclass(frozen=True)
class LockFolderState:
    """The lock folder in use, the claims in it, and what went wrong reading either."""

    choice: LockFolderChoice | None
    claims: dict[str, Holder] | None
    error: LockFolderError | None

    def to_json(self) -> dict[str, Any]:
        """``{"path", "source", "machine", "machine_source", "warning", "error"}``."""
        base = self.choice.to_json() if self.choice else {"path": None, "source": None}
        return {**base, "error": str(self.error) if self.error else None}

    def notes(self) -> list[tuple[str, str]]:
        """(text, style) lines to print under a table."""
        lines: list[tuple[str, str]] = []
        if self.choice is not None:
            lines.append((f"lock folder: {self.choice.path} ({self.choice.source})", "dim"))
            if self.choice.warning:
                lines.append((f"warning: {self.choice.warning}", "yellow"))
        if self.error is not None:
            lines.append((f"error: claims unknown: {self.error}", "red"))
        return lines


def read_lock_folder(with_claims: bool = True) -> LockFolderState:
    """The lock folder this process uses, and (``with_claims``) the claims held in it."""
    from gpukit.sharing.claims import current_claims
    from gpukit.sharing.lock_folder import lock_folder_choice

    try:
        choice = lock_folder_choice()
    except LockFolderError as exc:
        return LockFolderState(None, None, exc)
    if not with_claims:
        return LockFolderState(choice, None, None)
    try:
        return LockFolderState(choice, current_claims(choice.path), None)
    except LockFolderError as exc:
        return LockFolderState(choice, None, exc)
