"""``gk.acquire``: pick GPUs, wait in line for them if asked, and claim them, in one call.

>>> import gpukit as gk
>>> with gk.acquire(2, min_free="20GiB", wait=True, timeout=3600) as held:   # doctest: +SKIP
...     os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, held.indices))

This is what ``gpukit run`` does before it starts its command, so a Python program gets the
same behaviour: the same criteria, the same fair line of waiters (:mod:`gpukit.gpus.waiting`),
the same per-user limits (:mod:`gpukit.gpus.policy`), the same errors and exit codes.

Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import replace

from gpukit.errors import ClaimError, InvalidArgumentError, UserLimitError, check_bool
from gpukit.gpus.claims import Claim, claim, current_claims, lock_dir
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.gpus.policy import holdings, load_policy
from gpukit.gpus.select import (
    ORDERS,
    Criteria,
    Order,
    assess,
    check_user_limit,
    choose,
    within_grant,
)
from gpukit.gpus.select import no_gpu_error as _no_gpu_error
from gpukit.gpus.waiting import wait_and_claim
from gpukit.untrusted import MAX_SECONDS

__all__ = ["POLL_VAR", "acquire", "poll_interval"]

POLL_VAR = "GPUKIT_POLL_INTERVAL"
"""Seconds between two readings of the GPUs while waiting, when ``poll`` is not given."""
_DEFAULT_POLL = 2.0
# Another process may claim a GPU between reading the claims and locking it: read again.
_CLAIM_TRIES = 3


def _seconds(
    value: object,
    what: str,
    *,
    zero: bool,
    example: str,
    forever: bool = False,
    most: float = math.inf,
) -> float:
    """``value`` as a number of seconds, or InvalidArgumentError saying what it is.

    NaN, negative numbers and numbers above ``most`` are refused; infinity only where it means
    ``forever``.
    """
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    endless = number == math.inf and forever
    if (
        number is None
        or not (math.isfinite(number) or endless)
        or number < 0
        or (number == 0 and not zero)
        or (number > most and not endless)
    ):
        least = "0 or more" if zero else "more than 0"
        upto = f" up to {most:g}" if most < math.inf else ""
        raise InvalidArgumentError(
            f"{what}={value!r} is not a number of seconds.",
            hint=f"Use {least}{upto}, e.g. {example}.",
        )
    return number


def poll_interval(poll: float | None = None) -> float:
    """Seconds between polls: ``poll``, else ``$GPUKIT_POLL_INTERVAL``, else 2.

    Raises InvalidArgumentError for anything but a number above 0 and up to a year, the
    environment variable included, whether or not anything will wait.
    """
    if poll is not None:
        return _seconds(poll, "poll", zero=False, example="poll=2", most=MAX_SECONDS)
    configured = os.environ.get(POLL_VAR)
    if configured is None:
        return _DEFAULT_POLL
    return _seconds(configured, POLL_VAR, zero=False, example=f"{POLL_VAR}=2", most=MAX_SECONDS)


def acquire(
    n: int = 1,
    *,
    min_free: int | float | str | None = None,
    max_util: float | None = None,
    max_processes: int | None = None,
    exclude: Iterable[int | str] = (),
    order: Order = "free",
    wait: bool = False,
    timeout: float | None = None,
    poll: float | None = None,
    settle: int = 3,
    command: str | None = None,
    on_status: Callable[[str], None] | None = None,
    read: Callable[[], Inventory] = inventory,
    all_gpus: bool = False,
) -> Claim:
    """Claim ``n`` GPUs that meet the criteria, waiting in line for them if asked.

    The criteria are :func:`gpukit.pick`'s. Without ``wait`` the best qualifying GPUs are
    claimed now, or NoGpuAvailableError explains GPU by GPU why too few qualify. With ``wait``
    (or a ``timeout``, which implies it) this process joins the machine's line of waiters and
    is served in arrival order once ``n`` GPUs have qualified for ``settle`` polls in a row
    (a neighbour may still be loading), polling every ``poll`` seconds
    (default ``$GPUKIT_POLL_INTERVAL`` or 2); after ``timeout`` seconds it raises
    WaitTimeoutError (exit 124). It never waits for what cannot come: too few GPUs that could
    ever qualify (excluded, in MIG mode, lost by NVML, too small) or a request above the
    lock folder's per-user limit fail at once. ``command`` is recorded in the claim and the
    ticket for ``gpukit list`` and ``gpukit queue`` (default: this process's command line);
    ``on_status`` receives a line of text at each poll; ``read`` reads the GPUs (default
    :func:`gpukit.inventory`; tests pass a stand-in). Only the GPUs this process was granted
    (``CUDA_VISIBLE_DEVICES``, or Slurm's ``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS``) are
    chosen from, unless ``all_gpus``.

    Raises InvalidArgumentError for bad arguments (an ``exclude`` naming a GPU the machine
    does not have included), UserLimitError (exit 4) when this user already holds their share,
    PolicyError (exit 5) for a policy file gpukit refuses, LockFolderError (exit 5) for a lock
    folder it refuses or cannot write, NoDriverError (exit 3) without NVML.

    >>> held = acquire(1, max_util=10)                     # doctest: +SKIP
    >>> held.indices, held.release()                       # doctest: +SKIP
    ([3], None)
    """
    check_bool("wait", wait)
    check_bool("all_gpus", all_gpus)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgumentError(
            f"Cannot acquire {n!r} GPUs.", hint="Ask for 1 or more, as an int."
        )
    if order not in ORDERS:
        raise InvalidArgumentError(
            f"order={order!r} is not an order gpukit knows.", hint=f"Use one of {ORDERS}."
        )
    if not isinstance(settle, int) or isinstance(settle, bool) or settle < 1:
        raise InvalidArgumentError(
            f"settle={settle!r} is not a number of polls.", hint="Use 1 or more, e.g. settle=3."
        )
    interval = poll_interval(poll)
    limit = None
    if timeout is not None:
        limit = _seconds(timeout, "timeout", zero=True, example="timeout=3600", forever=True)
    criteria = Criteria.make(
        min_free=min_free, max_util=max_util, max_processes=max_processes, exclude=exclude
    )
    folder = lock_dir()
    policy = load_policy(folder)
    inv = read()
    criteria.check_exclude(inv)
    if not all_gpus:
        inv, criteria = within_grant(inv, n, criteria)
        read = _granted_reader(read, criteria, inv)
    if wait or limit is not None:
        return wait_and_claim(
            n,
            criteria,
            order=order,
            timeout=None if limit == math.inf else limit,
            settle=settle,
            poll=interval,
            command=command,
            policy=policy,
            folder=folder,
            on_status=on_status or (lambda text: None),
            read=read,
        )
    if sum(criteria.could_ever_qualify(g) for g in inv.gpus) < n:
        raise _no_gpu_error(inv, n, criteria, assess(inv, criteria, current_claims(folder)))
    check_user_limit(n, policy)
    for attempt in range(_CLAIM_TRIES):
        gpus = choose(inv, n, criteria, order=order, claims=current_claims(folder))
        try:
            held = claim(gpus, command=command, folder=folder)
        except ClaimError:
            if attempt + 1 == _CLAIM_TRIES:
                raise
            continue
        # Another process of this user may have claimed at the same moment: never past the
        # limit, even for a moment's race; give these back and say so.
        if policy.refusal(os.getuid(), 0, holdings(folder)) is not None:
            held.release()
            raise UserLimitError(
                policy.explain(os.getuid(), n, holdings(folder)),
                hint="Another of your processes claimed GPUs at the same moment; try again, or "
                "wait with `gpukit run --wait`.",
            )
        return held
    raise AssertionError("unreachable")


def _granted_reader(
    read: Callable[[], Inventory], criteria: Criteria, first: Inventory
) -> Callable[[], Inventory]:
    """``read`` narrowed to the granted GPUs, giving ``first`` (already read) once first.

    A waiter then counts and describes the GPUs its job may use ("0 of 2 qualify"), as
    ``gpukit pick`` does, not every GPU of the machine.
    """
    if criteria.grant is None:
        return read
    pending = [first]

    def granted() -> Inventory:
        inv = pending.pop() if pending else read()
        return replace(inv, gpus=tuple(g for g in inv.gpus if criteria.grants(g)))

    return granted
