"""gk.pick: the machine's GPUs judged against criteria, with the claims and the policy in force.

>>> import gpukit as gk
>>> [g.index for g in gk.pick(2)]                          # doctest: +SKIP
[2, 4]
>>> gk.pick(1, min_free="60GiB", max_util=10)              # doctest: +SKIP
Traceback (most recent call last):
NoGpuAvailableError: Asked for 1 GPU(s) with at least 60 GiB free, at most 10% busy: ...
  GPU 3: 41.5 GiB free < 60 GiB; 1 process (bob, jupyter-kernel)

The judging itself is pure (:mod:`gpukit.gpus.select`); this module adds what is read from the
lock folder: who holds which GPU (:mod:`.claims`) and how many one user may hold
(:mod:`.policy`). Nothing here imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from gpukit.errors import UserLimitError
from gpukit.gpus.criteria import Criteria
from gpukit.gpus.inventory import GPU, Inventory
from gpukit.gpus.select import Order, choose, within_grant
from gpukit.holders import Holder
from gpukit.sharing.claims import current_claims
from gpukit.sharing.policy import Policy, holdings, load_policy

__all__ = ["check_user_limit", "pick"]


def pick(
    n: int = 1,
    *,
    min_free: int | float | str | None = None,
    max_util: float | None = None,
    max_processes: int | None = None,
    exclude: Iterable[int | str] = (),
    order: Order = "free",
    inventory: Inventory | None = None,
    claims: Mapping[str, Holder] | None = None,
    all_gpus: bool = False,
) -> list[GPU]:
    """Choose ``n`` GPUs that meet the criteria, best first (most free memory, by default).

    Reading the machine itself, it chooses only among the GPUs granted to this process by
    ``CUDA_VISIBLE_DEVICES`` (or Slurm's ``SLURM_JOB_GPUS``), unless ``all_gpus=True``.

    ``min_free``: bytes or a size (``"8GiB"``); ``max_util``: percent; ``max_processes``: how
    many processes may already hold memory on it (default 0, or no limit when ``min_free`` is
    given); ``exclude``: NVML indices or UUIDs; ``order``: ``"free"``, ``"util"`` or ``"index"``.
    GPUs claimed by other gpukit processes never qualify. ``inventory`` and ``claims`` default to
    the machine's readings now; when ``claims`` is read here, the lock folder's policy
    (:mod:`gpukit.sharing.policy`) applies too.

    >>> gpus = pick(2, min_free="20GiB")                  # doctest: +SKIP
    >>> with gk.claim(gpus): ...                          # doctest: +SKIP

    Args:
        n: how many GPUs, 1 or more.
        min_free: the free memory a GPU needs: bytes, or a size such as ``"8GiB"``; None: any.
        max_util: the highest utilisation a GPU may have, in percent; None: any.
        max_processes: how many processes may already hold memory on it; None: 0, or no limit
            when ``min_free`` is given.
        exclude: NVML indices or UUIDs never to choose.
        order: which GPUs first: ``"free"`` (most free memory), ``"util"`` or ``"index"``.
        inventory: the machine's GPUs already read; None: read them now.
        claims: the claims already read; None: read them now (the policy then applies too).
        all_gpus: whether to choose among every GPU, not only those granted to this process,
            when the machine is read here (a given ``inventory`` is used as it is).

    Raises:
        NoGpuAvailableError: fewer than ``n`` GPUs qualify; the message explains each
            rejection (exit 4).
        UserLimitError: this user already holds their share under the policy (exit 4).
        InvalidArgumentError: a criterion or ``order`` is refused, or ``exclude`` names a GPU
            the machine does not have (exit 2).
        VisibleDevicesError: the grant (``CUDA_VISIBLE_DEVICES``, Slurm's) cannot be mapped
            to the machine's GPUs exactly.
        NoDriverError: no NVIDIA driver or NVML to read the GPUs from (exit 3).
        LockFolderError: the lock folder is refused (exit 5).
        PolicyError: the lock folder's policy.toml is refused (exit 5).
    """
    criteria = Criteria.make(
        min_free=min_free, max_util=max_util, max_processes=max_processes, exclude=exclude
    )
    if inventory is None:
        from gpukit.gpus.inventory import inventory as read_inventory

        inventory = read_inventory()
        if not all_gpus:
            inventory, criteria = within_grant(inventory, n, criteria)
    if claims is not None:
        return choose(inventory, n, criteria, order=order, claims=claims)
    gpus = choose(inventory, n, criteria, order=order, claims=current_claims())
    check_user_limit(n)
    return gpus


def check_user_limit(n: int, policy: Policy | None = None) -> None:
    """Raise UserLimitError when this user may not take ``n`` more GPUs under ``policy``.

    ``policy`` defaults to the lock folder's (:func:`~gpukit.sharing.policy.load_policy`).
    """
    policy = load_policy() if policy is None else policy
    if policy.limits.max_gpus_per_user is None:
        return
    held = holdings()
    if policy.refusal(os.getuid(), n, held) is not None:
        raise UserLimitError(
            policy.explain(os.getuid(), n, held),
            hint="Release a claim, ask for fewer GPUs, or wait for your own claims to end "
            "with `gpukit run --wait`."
            if policy.could_ever_allow(n)
            else "Waiting cannot help: ask for fewer GPUs, or ask the administrator.",
        )
