"""The torchrun that ``gpukit run --ddp`` starts: torchrun, which acts on the first signal it
passes on and only passes on the ones after it.

torchrun's agent answers a signal it handles by passing it to every worker and waiting for them
to end (``--shutdown-timeout``). A second signal during that wait cuts it short: the agent sends
SIGTERM to its workers, and a third ends the agent with its workers still running, on GPUs
gpukit then no longer claims. Second copies are the rule, not the exception: Slurm signals every
process of a step (``scancel --signal``, ``--signal=USR1@90``), so torchrun gets Slurm's copy and
gpukit's; a user presses Ctrl-C twice; Slurm sends SIGTERM at the time limit after its SIGUSR1.
Here every signal after the first goes to the workers' process groups (each worker leads its
own), and the agent goes on waiting for them. A torchrun ended by signal N exits with 128+N, as
a process killed by it would, instead of a traceback and 1.

``python -m gpukit.distributed.torchrun_agent ARGS`` takes torchrun's arguments. On a torch whose
agent has no ``_terminate_process_handler`` this is torchrun unchanged.
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import FrameType

from gpukit.supervise import children

__all__ = ["main"]


def _pass_on(signum: int) -> None:
    for pid in children(os.getpid()):
        try:
            os.killpg(pid, signum)  # torchrun starts each worker in a session of its own
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)  # a child that leads no group (not one of torchrun's)
        except PermissionError:
            pass


def main() -> int:
    """Run torchrun on ``sys.argv[1:]``; return its exit status."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.run import main as torchrun

    first = getattr(api, "_terminate_process_handler", None)
    if first is not None:
        acting: list[int] = []

        def handler(signum: int, frame: FrameType | None) -> None:
            if not acting:
                acting.append(signum)
                first(signum, frame)  # raises: the agent passes the signal on and waits
            _pass_on(signum)

        # The agent installs its handler by this module-level name when it starts the workers.
        api._terminate_process_handler = handler
    try:
        torchrun()
    except api.SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
