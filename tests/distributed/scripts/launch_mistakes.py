"""launch() of a function the workers cannot load (MODE=unloadable) or whose result cannot be
sent back (MODE=unpicklable); prints the WorkerFailedError and exits 3."""

from __future__ import annotations

import os
import sys
import threading

import gpukit as gk
from gpukit import distributed as dist


def returns_a_lock() -> threading.Lock:
    return threading.Lock()


if __name__ == "__main__":
    os.environ["ONLY_IN_PARENT_PID"] = str(os.getpid())
    import only_in_parent  # here only: spawned workers re-run this file without this block

    fn = only_in_parent.work if sys.argv[1] == "unloadable" else returns_a_lock
    try:
        dist.launch(fn, 2)
    except gk.WorkerFailedError as exc:
        print(exc)
        sys.exit(3)
