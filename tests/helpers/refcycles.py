"""How much cyclic garbage a call leaves: what the garbage collector would have to clean up."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any


def cyclic_garbage(call: Callable[[], Any]) -> int:
    """The number of objects in reference cycles that ``call()`` left unreachable.

    The collector is off during the call, so nothing is collected behind the count's back, and
    what was garbage before the call is collected first. The result is dropped before counting:
    only what the call left behind counts, not what it returned.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        call()
        return gc.collect()
    finally:
        if enabled:
            gc.enable()
