"""A module that worker processes cannot import, as a notebook's __main__ is for spawned ones.

The launching process names itself in ONLY_IN_PARENT_PID before importing it; workers inherit
that variable, and their own pid differs.
"""

from __future__ import annotations

import os

if os.environ.get("ONLY_IN_PARENT_PID") != str(os.getpid()):
    raise ImportError("only_in_parent cannot be imported in a worker")


def work() -> int:
    return 1
