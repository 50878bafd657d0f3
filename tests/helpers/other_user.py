"""Acting as another user in a test: a forked child that switches to uid 65534 (root only)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable

from gpukit.errors import GpukitError
from tests.helpers import NOBODY


def as_nobody(call: Callable[[], object]) -> list[str | None]:
    """Run ``call`` as another user (uid 65534) in a forked child; what came of it:
    ``["ok", repr(result)]``, ``[error type, message, hint]`` for a gpukit error, or
    ``[error type, str(error)]``. The child has 30 s, then SIGALRM ends it and the test fails.

    Args:
        call: what to run; every module it needs must be imported before (the other user may
            not read this Python's files)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(30)  # a child that blocks ends, and the test fails instead of hanging
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                result = call()
                answer: list[str | None] = ["ok", repr(result)]
            except GpukitError as exc:
                answer = [type(exc).__name__, exc.message, exc.hint]
            except BaseException as exc:
                answer = [type(exc).__name__, str(exc)]
            os.write(write_end, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    data = b""
    while chunk := os.read(read_end, 65536):
        data += chunk
    os.close(read_end)
    os.waitpid(pid, 0)
    assert data, f"the child acting as uid {NOBODY} ended without an answer"
    return json.loads(data)
