"""``gk.acquire``: pick GPUs, wait in line for them if asked, and claim them, in one call.

>>> import gpukit as gk
>>> with gk.acquire(2, min_free="20GiB", wait=True, timeout=3600) as held:   # doctest: +SKIP
...     os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, held.indices))

This is what ``gpukit run`` does before it starts its command, so a Python program gets the
same behaviour: the same criteria, the same fair line of waiters (:mod:`gpukit.sharing.tickets`),
the same per-user limits (:mod:`gpukit.sharing.policy`), the same errors and exit codes.

Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpukit.errors import ClaimError, InvalidArgumentError, UserLimitError, check_bool
from gpukit.gpus.criteria import Criteria
from gpukit.gpus.inventory import GPU, Inventory, inventory
from gpukit.gpus.select import ORDERS, Order, Verdict, assess, best_first, within_grant
from gpukit.gpus.select import no_gpu_error as _no_gpu_error
from gpukit.sharing.claims import Claim, claim, current_claims
from gpukit.sharing.lock_folder import lock_folder
from gpukit.sharing.pick import check_user_limit
from gpukit.sharing.policy import Limits, Policy, holdings, load_policy
from gpukit.sharing.tickets import wait_and_claim
from gpukit.untrusted import MAX_SECONDS

__all__ = ["POLL_VAR", "GpuRequest", "acquire", "acquire_request", "poll_interval"]

POLL_VAR = "GPUKIT_POLL_INTERVAL"
"""Seconds between two readings of the GPUs while waiting, when ``poll`` is not given."""
_DEFAULT_POLL = 2.0
# Another process may claim a GPU between reading the claims and locking it: read again.
_PICK_TRIES = 3


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


@dataclass(frozen=True)
class GpuRequest:
    """GPUs to acquire, checked once, when the request is made; what :func:`acquire_request` takes.

    ``n`` GPUs that meet ``criteria`` (:meth:`gpukit.gpus.criteria.Criteria.make`), best first by
    ``order``; ``wait`` in line for them (a ``timeout`` in seconds implies it; ``inf`` waits as
    long as it takes), polling every ``poll`` seconds and taking GPUs that qualified ``settle``
    polls in a row; only among the GPUs this process was granted unless ``all_gpus``.

    Every field is checked here and nowhere downstream, so a bad value is refused before any
    GPU or lock file is read, as InvalidArgumentError (exit 2). Once made, the request holds
    its final values: ``poll`` the seconds in force (given, else ``$GPUKIT_POLL_INTERVAL``,
    else 2), ``timeout`` a number of seconds or ``None`` (no limit), and ``wait`` True whenever
    a timeout was given. :meth:`make` builds one from :func:`acquire`'s arguments.

    >>> GpuRequest.make(2, min_free="20GiB", timeout=3600).wait
    True

    Args:
        n: how many GPUs, 1 or more (1).
        criteria: what a GPU must meet (:meth:`~gpukit.gpus.criteria.Criteria.make`); any GPU
            by default.
        order: which GPUs first: ``"free"`` (most free memory, the default), ``"util"`` or
            ``"index"``.
        wait: whether to wait in line for GPUs that do not qualify yet (False).
        timeout: seconds to wait at most, 0 or more (implies ``wait``); None or ``inf``: no
            limit.
        poll: seconds between readings, above 0 and up to a year; None:
            ``$GPUKIT_POLL_INTERVAL``, else 2.
        settle: polls in a row the GPUs must qualify in before they are claimed, 1 or more (3).
        all_gpus: whether to choose among every GPU, not only those granted to this process.

    Raises:
        InvalidArgumentError: a field is refused: ``n``, the criteria, ``order``, ``settle``,
            ``poll``, ``timeout``, or a switch that is not a bool (exit 2).
    """

    n: int = 1
    criteria: Criteria = field(default_factory=Criteria)
    order: Order = "free"
    wait: bool = False
    timeout: float | None = None
    poll: float | None = None
    settle: int = 3
    all_gpus: bool = False

    def __post_init__(self) -> None:
        check_bool("wait", self.wait)
        check_bool("all_gpus", self.all_gpus)
        n = self.n
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidArgumentError(
                f"Cannot acquire {n!r} GPUs.", hint="Ask for 1 or more, as an int."
            )
        if not isinstance(self.criteria, Criteria):
            raise InvalidArgumentError(
                f"criteria={self.criteria!r} are not Criteria.",
                hint="Make them with Criteria.make(min_free=..., ...), or use GpuRequest.make.",
            )
        if self.order not in ORDERS:
            raise InvalidArgumentError(
                f"order={self.order!r} is not an order gpukit knows.",
                hint=f"Use one of {ORDERS}.",
            )
        settle = self.settle
        if not isinstance(settle, int) or isinstance(settle, bool) or settle < 1:
            raise InvalidArgumentError(
                f"settle={settle!r} is not a number of polls.",
                hint="Use 1 or more, e.g. settle=3.",
            )
        object.__setattr__(self, "poll", poll_interval(self.poll))
        if self.timeout is not None:
            limit = _seconds(
                self.timeout, "timeout", zero=True, example="timeout=3600", forever=True
            )
            object.__setattr__(self, "timeout", None if limit == math.inf else limit)
            object.__setattr__(self, "wait", True)

    @classmethod
    def make(
        cls,
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
        all_gpus: bool = False,
    ) -> GpuRequest:
        """The request :func:`acquire`'s arguments describe (their meaning is said there).

        Args:
            n: how many GPUs, 1 or more.
            min_free: the free memory a GPU needs: bytes, or a size such as ``"8GiB"``; None:
                any.
            max_util: the highest utilisation a GPU may have, in percent; None: any.
            max_processes: how many processes may already hold memory on it; None: as
                :func:`~gpukit.pick`.
            exclude: NVML indices or UUIDs never to choose.
            order: which GPUs first: ``"free"`` (most free memory), ``"util"`` or ``"index"``.
            wait: whether to wait in line for GPUs that do not qualify yet.
            timeout: seconds to wait at most (implies ``wait``); None: no limit.
            poll: seconds between readings; None: ``$GPUKIT_POLL_INTERVAL`` or 2.
            settle: polls in a row the GPUs must qualify in before they are claimed.
            all_gpus: whether to choose among every GPU, not only those granted to this
                process.
        """
        criteria = Criteria.make(
            min_free=min_free, max_util=max_util, max_processes=max_processes, exclude=exclude
        )
        return cls(n, criteria, order, wait, timeout, poll, settle, all_gpus)


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
    chosen from, unless ``all_gpus``. The arguments make one :class:`GpuRequest`, checked
    once, which :func:`acquire_request` carries out.

    >>> held = acquire(1, max_util=10)                     # doctest: +SKIP
    >>> held.indices, held.release()                       # doctest: +SKIP
    ([3], None)

    Args:
        n: how many GPUs to claim, 1 or more.
        min_free: the free memory a GPU needs: bytes, or a size such as ``"8GiB"``; None: any.
        max_util: the highest utilisation a GPU may have, in percent; None: any.
        max_processes: how many processes may already hold memory on it; None: as :func:`pick`.
        exclude: NVML indices or UUIDs never to choose.
        order: which GPUs first: ``"free"`` (most free memory), ``"util"`` or ``"index"``.
        wait: whether to wait in line for GPUs that do not qualify yet.
        timeout: seconds to wait at most (implies ``wait``); None: no limit.
        poll: seconds between readings while waiting; None: ``$GPUKIT_POLL_INTERVAL`` or 2.
        settle: polls in a row the GPUs must qualify in before they are claimed.
        command: what the claim records as its command; None: this process's command line.
        on_status: called with a line of text at each poll while waiting, or None.
        read: reads the GPUs; by default :func:`gpukit.inventory`.
        all_gpus: whether to choose among every GPU, not only those granted to this process.

    Raises:
        NoGpuAvailableError: without ``wait``, too few GPUs qualify now; with it, too few
            could ever qualify (exit 4).
        WaitTimeoutError: waited ``timeout`` seconds in vain (exit 124).
        UserLimitError: this user already holds their share, or may never hold ``n`` (exit 4).
        ClaimError: other processes kept claiming the chosen GPUs first.
        InvalidArgumentError: a bad argument, an ``exclude`` naming a GPU the machine does not
            have included (exit 2).
        VisibleDevicesError: the grant cannot be mapped to the machine's GPUs exactly.
        NoDriverError: no NVIDIA driver or NVML (exit 3).
        LockFolderError: the lock folder is refused or cannot be written (exit 5).
        PolicyError: the lock folder's policy file is refused (exit 5).
    """
    request = GpuRequest.make(
        n,
        min_free=min_free,
        max_util=max_util,
        max_processes=max_processes,
        exclude=exclude,
        order=order,
        wait=wait,
        timeout=timeout,
        poll=poll,
        settle=settle,
        all_gpus=all_gpus,
    )
    return acquire_request(request, command=command, on_status=on_status, read=read)


def acquire_request(
    request: GpuRequest,
    machine: Inventory | None = None,
    *,
    folder: Path | None = None,
    policy: Policy | None = None,
    command: str | None = None,
    on_status: Callable[[str], None] | None = None,
    read: Callable[[], Inventory] = inventory,
) -> Claim:
    """Carry out ``request`` as :func:`acquire` does, from readings the caller may already have.

    ``machine`` is the machine's inventory as just read (default: ``read()`` now); a waiter
    reads the GPUs again with ``read`` at each later poll. ``folder`` is the lock folder
    (default :func:`.lock_folder`) and ``policy`` its policy, already loaded
    from it (default :func:`~gpukit.sharing.policy.load_policy`). The request is not checked
    again; only what needs the machine is (an ``exclude`` naming no GPU of it, the grant).

    Args:
        request: what to claim and how to wait, checked once (:class:`GpuRequest`).
        machine: the GPUs already read, or None to read them now.
        folder: the lock folder; None: :func:`.lock_folder`'s (``$GPUKIT_LOCK_DIR``, the
            configured one, or the default).
        policy: the lock folder's policy; None: read from ``folder``.
        command: what the claim records as its command; None: this process's command line.
        on_status: called with a line of text at each poll while waiting, or None.
        read: reads the GPUs, when ``machine`` is None and at each later poll; by default
            :func:`gpukit.inventory`.

    Raises:
        NoGpuAvailableError: too few GPUs qualify now (without ``wait``) or could ever
            (exit 4).
        WaitTimeoutError: waited the request's ``timeout`` in vain (exit 124).
        UserLimitError: this user already holds their share, or may never hold ``n`` (exit 4).
        ClaimError: other processes kept claiming the chosen GPUs first.
        InvalidArgumentError: the request's ``exclude`` names a GPU this machine does not have.
        VisibleDevicesError: the grant cannot be mapped to the machine's GPUs exactly.
        NoDriverError: no NVIDIA driver or NVML, when ``machine`` is read here (exit 3).
        LockFolderError: the lock folder is refused or cannot be written (exit 5).
        PolicyError: the lock folder's policy file is refused, when read here (exit 5).

    >>> request = GpuRequest.make(2, min_free="20GiB")     # doctest: +SKIP
    >>> with acquire_request(request, command="train") as held: ...   # doctest: +SKIP
    """
    if not isinstance(request, GpuRequest):
        raise InvalidArgumentError(
            f"Cannot acquire {request!r}: not a GpuRequest.",
            hint="Make one with GpuRequest.make(n, ...), or call gk.acquire(n, ...).",
        )
    folder = lock_folder() if folder is None else Path(folder)
    policy = load_policy(folder) if policy is None else policy
    inv = read() if machine is None else machine
    n, criteria = request.n, request.criteria
    if request.all_gpus:
        criteria.check_exclude(inv)
    else:  # checks the exclusions against the whole machine, then narrows to the grant
        inv, criteria = within_grant(inv, n, criteria)
    if request.wait:
        assert request.poll is not None  # resolved when the request was made
        return wait_and_claim(
            n,
            criteria,
            order=request.order,
            timeout=request.timeout,
            settle=request.settle,
            poll=request.poll,
            command=command,
            policy=policy,
            folder=folder,
            on_status=on_status or (lambda text: None),
            read=_polls(read, criteria, inv),
        )
    verdicts = assess(inv, criteria, current_claims(folder))
    if sum(criteria.could_ever_qualify(g) for g in inv.gpus) < n:
        raise _no_gpu_error(inv, n, criteria, verdicts)
    check_user_limit(n, policy)
    limits = policy.limits != Limits()
    for attempt in range(_PICK_TRIES):
        if attempt:
            verdicts = assess(inv, criteria, current_claims(folder))
        gpus = _best(inv, n, criteria, request.order, verdicts)
        try:
            held = claim(gpus, command=command, folder=folder)
        except ClaimError:
            if attempt + 1 == _PICK_TRIES:
                raise
            continue
        # Another process of this user may have claimed at the same moment: never past the
        # limit, even for a moment's race; give these back and say so.
        if limits and policy.refusal(os.getuid(), 0, holdings(folder)) is not None:
            held.release()
            raise UserLimitError(
                policy.explain(os.getuid(), n, holdings(folder)),
                hint="Another of your processes claimed GPUs at the same moment; try again, or "
                "wait with `gpukit run --wait`.",
            )
        return held
    raise AssertionError("unreachable")


def _best(
    inv: Inventory, n: int, criteria: Criteria, order: str, verdicts: list[Verdict]
) -> list[GPU]:
    """The ``n`` best qualifying GPUs by ``verdicts``, or NoGpuAvailableError saying why not."""
    good = best_first((v.gpu for v in verdicts if v.ok), order)
    if len(good) < n:
        raise _no_gpu_error(inv, n, criteria, verdicts)
    return good[:n]


def _polls(
    read: Callable[[], Inventory], criteria: Criteria, first: Inventory
) -> Callable[[], Inventory]:
    """A waiter's readings: ``first`` (already read), then ``read()`` at each later poll.

    Under a grant each reading is narrowed to the granted GPUs, so that a waiter counts and
    describes the GPUs its job may use ("0 of 2 qualify"), as ``gpukit pick`` does, not every
    GPU of the machine.
    """
    pending = [first]

    def reading() -> Inventory:
        inv = pending.pop() if pending else read()
        if criteria.grant is None:
            return inv
        return replace(inv, gpus=tuple(g for g in inv.gpus if criteria.grants(g)))

    return reading
