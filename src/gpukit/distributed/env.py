"""Where this process sits in a distributed run, read from what the launcher put in the environment.

torchrun (and ``gk.distributed.launch``) set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. SLURM's ``srun`` sets
``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_LOCALID`` instead, and leaves the address of the
rendezvous to the job script. Nothing here starts a process group: that is ``torch.distributed``'s
job, called from :mod:`gpukit.distributed.process_group`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gpukit.errors import DistributedError

__all__ = ["LaunchEnv", "read_env"]


@dataclass(frozen=True)
class LaunchEnv:
    """The ranks a launcher gave this process; ``source``: ``"torchrun"``, ``"slurm"`` or None."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str | None

    @property
    def launched(self) -> bool:
        """True when a launcher started this process as part of a group (even a group of one)."""
        return self.source is not None


_SINGLE = LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, source=None)


def _int(env: Mapping[str, str], name: str, source: str, default: int | None = None) -> int:
    raw = env.get(name) or (None if default is None else str(default))
    if raw is None:
        raise DistributedError(
            f"{source} started this process without {name} in the environment.",
            hint="Start the script with torchrun (or srun), or unset RANK to run a single process.",
        )
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(
            f"{name}={raw!r} is not an integer.", hint=f"Set {name} to a whole number, or unset it."
        ) from None


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    # SLURM_NTASKS_PER_NODE is only set when the job asked for it; SLURM_TASKS_PER_NODE is always
    # there but may read "4(x2),3" on uneven allocations, where only this node's count matters.
    raw = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    first = raw.split(",")[0].split("(")[0]
    return int(first) if first.isdigit() else None


def _check(launch: LaunchEnv, env: Mapping[str, str]) -> LaunchEnv:
    if launch.world_size < 1 or not 0 <= launch.rank < launch.world_size:
        raise DistributedError(
            f"rank {launch.rank} does not fit in a world of {launch.world_size} processes "
            f"({launch.source}).",
            hint="Check the launcher's arguments; ranks run from 0 to world size - 1.",
        )
    if not 0 <= launch.local_rank < launch.local_world_size:
        raise DistributedError(
            f"local rank {launch.local_rank} does not fit in {launch.local_world_size} "
            f"processes per machine ({launch.source}).",
            hint="Check the launcher's --nproc-per-node (or SLURM --ntasks-per-node).",
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing and launch.world_size > 1:
        raise DistributedError(
            f"{launch.source} started rank {launch.rank} of {launch.world_size}, but "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set, so the "
            "processes cannot find each other.",
            hint="Under SLURM, export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST "
            "| head -n1) and MASTER_PORT=29500 in the job script; or start with torchrun.",
        )
    return launch


def read_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's environment: torchrun's variables first, then SLURM's, else one process.

    >>> read_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    ...           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}).rank
    1
    """
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:
        # torchrun sets all of these; a bare RANK without WORLD_SIZE is a broken hand-made setup.
        world = _int(env, "WORLD_SIZE", "The launcher")
        launch = LaunchEnv(
            rank=_int(env, "RANK", "The launcher"),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", "The launcher", 0),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", "The launcher", 0) or world,
            source="torchrun",
        )
        return _check(launch, env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS", "srun")
        if world == 1:
            # One SLURM task is an ordinary single process: no group, no rendezvous needed.
            return _SINGLE
        launch = LaunchEnv(
            rank=_int(env, "SLURM_PROCID", "srun"),
            world_size=world,
            local_rank=_int(env, "SLURM_LOCALID", "srun", 0),
            local_world_size=_slurm_tasks_per_node(env) or world,
            source="slurm",
        )
        return _check(launch, env)
    return _SINGLE
