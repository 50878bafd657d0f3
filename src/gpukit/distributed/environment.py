"""Where this process sits in a job, read from what the launcher or the scheduler set.

Launchers and schedulers each describe a job in their own environment variables. This module
reads them, in this order (the first that applies wins: the launcher that started this process
comes before the scheduler around it, so torchrun started by ``srun`` reads as torchrun, and a
rank of ``mpirun`` inside a Slurm step reads as Open MPI):

- **torchrun** (and ``gk.distributed.launch``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
- **Open MPI** (``mpirun``): ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``,
  ``_LOCAL_SIZE``; the address must be given as ``MASTER_ADDR`` (``mpirun -x MASTER_ADDR=...``),
  the port derives from the id Open MPI gives the job (``OMPI_MCA_ess_base_jobid``), so two
  ``mpirun`` on one host use different ports. Inside a Slurm allocation ``mpirun`` starts its
  remote daemons with ``srun``, and its ranks inherit that step's ``SLURM_PROCID=0`` and
  ``SLURM_NTASKS=1``: Open MPI's variables describe the process, Slurm's the step around it.
- **Slurm** (``srun``, one process per task): ``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_TASKS_PER_NODE``, the node list and the job id,
  inside an ``srun`` step (``SLURM_STEP_ID``); the job's batch script is a single process.
  The rendezvous is the first host of the node list (expanded as ``scontrol show hostnames``
  does) on a port derived from ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``, so every rank of a step
  agrees on it without anything exported by hand, and two jobs, or two steps of one job, on
  the same nodes use different ports.
- **SkyPilot** (one process per node): ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS``,
  ``SKYPILOT_NUM_NODES``, ``SKYPILOT_NUM_GPUS_PER_NODE``.

Explicit ``MASTER_ADDR`` / ``MASTER_PORT`` always win over derived ones. Nothing here starts a
process group or reads a device: :func:`environment` is a pure function of a mapping.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from gpukit.distributed.hostlist import expand_hostlist
from gpukit.distributed.ports import DEFAULT_PORT, job_port
from gpukit.errors import DistributedError

__all__ = [
    "Environment",
    "check_local_ranks_fit",
    "environment",
    "launcher_names",
    "slurm_allocation_nodes",
]


@dataclass(frozen=True)
class Environment:
    """This process's place in a job: ranks, nodes, the rendezvous, and who said so.

    ``source`` is ``"torchrun"``, ``"slurm"``, ``"mpi"``, ``"skypilot"``, or ``None`` for a
    single process. ``cuda_index`` is the CUDA device this process should use among those it
    sees: its ``local_rank``, or 0 when the scheduler gave each task its own GPUs
    (``srun --gpus-per-task``; then ``bound_gpus`` is True). ``job_id`` names the job (and the
    step) for a rendezvous id.

    Args:
        rank: this process's global rank, 0 to ``world_size - 1`` (0).
        world_size: how many processes the job has (1).
        local_rank: its rank among the processes of its node (0).
        local_world_size: how many of them run on its node (1).
        node_rank: its node's rank, 0 to ``num_nodes - 1`` (0).
        num_nodes: how many nodes the job has (1).
        master_addr: the rendezvous host; None: not set (a single process).
        master_port: the rendezvous TCP port; None: not set.
        source: the launcher that said so: ``"torchrun"``, ``"slurm"``, ``"mpi"``,
            ``"skypilot"``; None: a single process.
        job_id: the job (and step) id, for a rendezvous id; None: unknown.
        cuda_index: the CUDA index among those it sees that this process should use (0).
        bound_gpus: whether the scheduler gave each task its own GPUs (False).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    source: str | None = None
    job_id: str | None = None
    cuda_index: int = 0
    bound_gpus: bool = False

    @property
    def launched(self) -> bool:
        """True when a launcher started this process as part of a group (even a group of one)."""
        return self.source is not None


SINGLE = Environment()

# -- reading the variables -------------------------------------------------------------------


def _int(env: Mapping[str, str], name: str, source: str, default: int | None = None) -> int:
    raw = env.get(name) or (None if default is None else str(default))
    if raw is None:
        raise DistributedError(
            f"{source} started this process without {name} in the environment.",
            hint=f"Set {name}, or unset {', '.join(_BY_NAME[source].variables)} to run a single "
            "process.",
        )
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(
            f"{name}={raw!r} is not an integer.", hint=f"Set {name} to a whole number, or unset it."
        ) from None


def _tasks_per_node(raw: str) -> list[int] | None:
    """Slurm's ``"4(x2),3"`` -> ``[4, 4, 3]``; None when it cannot be read."""
    counts: list[int] = []
    for part in raw.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _rendezvous(
    env: Mapping[str, str], addr: str | None, port: int | None
) -> tuple[str | None, int | None]:
    """Explicit MASTER_ADDR / MASTER_PORT win over what the job says."""
    explicit_port = env.get("MASTER_PORT")
    if explicit_port:
        try:
            port = int(explicit_port)
        except ValueError:
            raise DistributedError(
                f"MASTER_PORT={explicit_port!r} is not a port number.",
                hint="Set MASTER_PORT to a free TCP port (1024-65535), or unset it.",
            ) from None
    return env.get("MASTER_ADDR") or addr, port


def _torchrun(env: Mapping[str, str]) -> Environment:
    world = _int(env, "WORLD_SIZE", "torchrun")
    rank = _int(env, "RANK", "torchrun")
    local_world = _int(env, "LOCAL_WORLD_SIZE", "torchrun", 0) or world
    local_rank = _int(env, "LOCAL_RANK", "torchrun", 0)
    addr, port = _rendezvous(env, None, None)
    nodes = _int(env, "GROUP_WORLD_SIZE", "torchrun", 0) or max(world // local_world, 1)
    node = _int(env, "GROUP_RANK", "torchrun", rank // local_world if local_world else 0)
    return Environment(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node,
        num_nodes=nodes,
        master_addr=addr,
        master_port=port,
        source="torchrun",
        job_id=env.get("TORCHELASTIC_RUN_ID"),
        cuda_index=local_rank,
    )


def _slurm_nodes(env: Mapping[str, str]) -> tuple[str, list[str]]:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            return name, expand_hostlist(env[name])
    return "SLURM_JOB_NODELIST", []


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    # srun sets the step id for the tasks it starts. The batch script and an salloc shell have
    # none, yet they carry SLURM_PROCID=0 and the job's SLURM_NTASKS: read as rank 0 of N, a
    # script started there would wait forever for N - 1 peers that nothing starts.
    return bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))


def slurm_allocation_nodes(env: Mapping[str, str]) -> int:
    """How many nodes the Slurm job holds, seen from outside any step (1 when not in a job)."""
    raw = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    return int(raw) if raw.isdigit() else 1


def _slurm(env: Mapping[str, str]) -> Environment:
    world = _int(env, "SLURM_NTASKS", "slurm")
    rank = _int(env, "SLURM_PROCID", "slurm")
    local_rank = _int(env, "SLURM_LOCALID", "slurm", 0)
    node = _int(env, "SLURM_NODEID", "slurm", 0)
    list_name, hosts = _slurm_nodes(env)
    nodes_name = next(
        (n for n in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES") if env.get(n)), "SLURM_NNODES"
    )
    nodes = _int(env, nodes_name, "slurm", len(hosts) or 1)
    per_node_name = next(
        (n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(n)), None
    )
    per_node_raw = env[per_node_name] if per_node_name else ""
    per_node = _tasks_per_node(per_node_raw) if per_node_raw else None
    if per_node is not None and (sum(per_node) != world or len(per_node) != nodes):
        raise DistributedError(
            f"Slurm's task counts do not add up: {per_node_name}={per_node_raw} is "
            f"{sum(per_node)} tasks on {len(per_node)} nodes, but SLURM_NTASKS={world} and "
            f"{nodes_name}={nodes}.",
            hint="Start the job with srun from inside the allocation, not with variables copied "
            "from another job; unset SLURM_* to run a single process.",
        )
    if hosts and len(hosts) != nodes:
        raise DistributedError(
            f"{list_name}={env[list_name]} names {len(hosts)} hosts, but the step has {nodes} "
            f"nodes ({nodes_name}).",
            hint="Start the job with srun from inside the allocation, or set MASTER_ADDR.",
        )
    if per_node is not None and 0 <= node < len(per_node):
        local_world = per_node[node]
    else:
        local_world = _int(env, "SLURM_NTASKS_PER_NODE", "slurm", 0) or world
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    first = hosts[0] if hosts else None
    distribution = env.get("SLURM_DISTRIBUTION", "")
    if distribution.startswith("arbitrary") and world > 1 and not env.get("MASTER_ADDR"):
        # srun -m arbitrary places the tasks as a host file says: rank 0 may run on any node
        # of the list, and the list's first host would wait for a peer that never joins.
        raise DistributedError(
            f"Slurm placed the tasks with SLURM_DISTRIBUTION={distribution}: rank 0 may run on "
            f"any node of {list_name}={env.get(list_name)}, and nothing in the environment says "
            "which, so the processes cannot agree on a rendezvous address.",
            hint="Set MASTER_ADDR to the host of rank 0 (the first line of the SLURM_HOSTFILE "
            "you gave srun), or use srun's default distribution (-m block).",
        )
    addr, port = _rendezvous(env, first, job_port(job, step) if job else None)
    cuda, bound = local_rank, False
    if env.get("SLURM_GPUS_PER_TASK") and _visible_count(env) in (None, *range(local_world)):
        cuda, bound = 0, True  # --gpus-per-task binds each task to its GPUs: seen from cuda:0
    job_id = None if job is None else (f"{job}.{step}" if step else job)
    if world == 1:
        # One Slurm task is an ordinary single process: no group, no rendezvous needed.
        return replace(SINGLE, job_id=job_id)
    return Environment(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node,
        num_nodes=nodes,
        master_addr=addr,
        master_port=port,
        source="slurm",
        job_id=job_id,
        cuda_index=cuda,
        bound_gpus=bound,
    )


def _mpi(env: Mapping[str, str]) -> Environment:
    world = _int(env, "OMPI_COMM_WORLD_SIZE", "mpi")
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "mpi")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "mpi", 0) or world
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "mpi", 0)
    if world % local_world:
        raise DistributedError(
            f"Open MPI's task counts do not add up: OMPI_COMM_WORLD_SIZE={world} is not a "
            f"multiple of OMPI_COMM_WORLD_LOCAL_SIZE={local_world}.",
            hint="Start the same number of processes on every node (mpirun --npernode N).",
        )
    job = env.get("OMPI_MCA_ess_base_jobid") or None  # each mpirun's job has its own
    addr, port = _rendezvous(env, None, job_port(job) if job else DEFAULT_PORT)
    found = Environment(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=rank // local_world,
        num_nodes=world // local_world,
        master_addr=addr,
        master_port=port,
        source="mpi",
        job_id=job,
        cuda_index=local_rank,
    )
    if _in_slurm_step(env):
        _mpi_inside_slurm(env, found)
    return found


def _mpi_inside_slurm(env: Mapping[str, str], mpi: Environment) -> None:
    """Refuse Open MPI ranks whose Slurm step started several ``mpirun`` on this node.

    ``mpirun`` inside an allocation starts its daemons with ``srun``, one task per node, and
    its ranks inherit that step's variables; ``srun -n1 mpirun`` gives them a step of one task.
    Open MPI's variables then describe the rank. But a step that put several tasks on this
    node, each of which ran ``mpirun``, made as many separate worlds, each complete in its own
    eyes: every one would train alone.
    """
    slurm_world = _int(env, "SLURM_NTASKS", "slurm", 1)
    slurm_rank = _int(env, "SLURM_PROCID", "slurm", 0)
    if slurm_world <= 1 or (slurm_world, slurm_rank) == (mpi.world_size, mpi.rank):
        return  # a step of one task, or srun itself started the MPI ranks: the two agree
    per_node_name = next(
        (n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(n)), ""
    )
    per_node = _tasks_per_node(env[per_node_name]) if per_node_name else None
    node = _int(env, "SLURM_NODEID", "slurm", 0)
    here = per_node[node] if per_node and 0 <= node < len(per_node) else 1
    if here > 1:
        raise DistributedError(
            f"Open MPI started rank {mpi.rank} of {mpi.world_size} (OMPI_COMM_WORLD_RANK, "
            f"OMPI_COMM_WORLD_SIZE) inside a Slurm step of {slurm_world} tasks "
            f"(SLURM_NTASKS), {here} of them on this node ({per_node_name}={env[per_node_name]}"
            f"): each task ran its own mpirun, so the world sizes disagree and each mpirun's "
            "ranks would train apart from the others'.",
            hint="Start mpirun once (from the batch script, or `srun -n1 mpirun ...`), or let "
            "srun start the tasks without mpirun: `srun -n N python train.py`.",
        )


def _skypilot(env: Mapping[str, str]) -> Environment:
    nodes = _int(env, "SKYPILOT_NUM_NODES", "skypilot")
    node = _int(env, "SKYPILOT_NODE_RANK", "skypilot")
    ips = env.get("SKYPILOT_NODE_IPS", "").split()
    if ips and len(ips) != nodes:
        raise DistributedError(
            f"SkyPilot's node counts do not add up: SKYPILOT_NODE_IPS lists {len(ips)} "
            f"addresses, but SKYPILOT_NUM_NODES={nodes}.",
            hint="Run the command from SkyPilot's `run:` section, or set MASTER_ADDR.",
        )
    task = env.get("SKYPILOT_TASK_ID")
    addr, port = _rendezvous(env, ips[0] if ips else None, job_port(task) if task else None)
    if port is None:
        port = DEFAULT_PORT
    return Environment(
        rank=node,
        world_size=nodes,
        local_rank=0,
        local_world_size=1,
        node_rank=node,
        num_nodes=nodes,
        master_addr=addr,
        master_port=port,
        source="skypilot",
        job_id=task,
        cuda_index=0,
    )


def _visible_count(env: Mapping[str, str]) -> int | None:
    """How many GPUs CUDA_VISIBLE_DEVICES lets CUDA see; None when it is unset."""
    from gpukit.gpus.visible import parse_visible_devices

    entries = parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    return None if entries is None else len(entries)


# How messages name the local rank and the processes per node of a launcher without variables
# for them (SkyPilot starts one process per node), or of a single process.
_NO_LAUNCHER = ("local rank", "processes per node")


@dataclass(frozen=True)
class _Launcher:
    """One launcher or scheduler: how its variables show it started this process, how to read them.

    ``detect`` and ``read`` are pure functions of the mapping they are given: unlike Lightning's
    ``ClusterEnvironment``, nothing here sets variables, in the mapping or in ``os.environ``.
    ``read`` runs only where ``detect`` said yes; it returns ``source=name`` (or, for a job
    that is an ordinary single process, ``source=None``) or raises
    :class:`~gpukit.errors.DistributedError`.
    """

    name: str
    """``Environment.source`` for the processes it started."""
    detect: Callable[[Mapping[str, str]], bool]
    read: Callable[[Mapping[str, str]], Environment]
    variables: tuple[str, ...]
    """What to unset to run a single process, named in hints."""
    local_names: tuple[str, str] = _NO_LAUNCHER
    """The variables of the local rank and of the processes per node, named in errors."""


_LAUNCHERS: tuple[_Launcher, ...] = (
    # The launcher that started this process before the scheduler around it: torchrun under
    # srun reads as torchrun, and mpirun's ranks as Open MPI before the srun step they
    # inherit from mpirun's daemons (or mpirun itself), which describes that step.
    _Launcher(
        name="torchrun",
        detect=lambda env: "RANK" in env or "WORLD_SIZE" in env,
        read=_torchrun,
        variables=("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        local_names=("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ),
    _Launcher(
        name="mpi",
        detect=lambda env: "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env,
        read=_mpi,
        variables=(
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        local_names=("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ),
    _Launcher(
        name="slurm",
        detect=lambda env: "SLURM_PROCID" in env and "SLURM_NTASKS" in env and _in_slurm_step(env),
        read=_slurm,
        variables=("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE"),
        local_names=("SLURM_LOCALID", "SLURM_TASKS_PER_NODE"),
    ),
    _Launcher(
        name="skypilot",
        detect=lambda env: "SKYPILOT_NODE_RANK" in env and "SKYPILOT_NUM_NODES" in env,
        read=_skypilot,
        variables=("SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES"),
    ),
)
"""Every launcher gpukit reads, in priority order: the first whose ``detect`` says yes wins."""

_BY_NAME = {launcher.name: launcher for launcher in _LAUNCHERS}


def launcher_names(source: str | None) -> tuple[str, str]:
    """The variables of the local rank and of the processes per node, for messages."""
    found = _BY_NAME.get(source or "")
    return _NO_LAUNCHER if found is None else found.local_names


def check_local_ranks_fit(found: Environment, visible: int, what: str) -> None:
    """Refuse local ranks beyond the ``visible`` GPUs, which would hang in the rendezvous.

    Every process of the node sees the same counts, so every one refuses, not only the one
    without a GPU: the others would wait for it in the rendezvous.
    """
    rank_var, size_var = launcher_names(found.source)
    # The last local rank's device: processes of a node share its GPUs, one each by local
    # rank, unless the scheduler gave each its own (then each uses its cuda:0).
    top = found.cuda_index if found.bound_gpus else found.local_world_size - 1
    if visible > 0 and top >= visible:
        whose = "this process's" if found.bound_gpus else f"local rank {top}'s"
        raise DistributedError(
            f"{found.source} started local rank {found.local_rank} ({rank_var}) of "
            f"{found.local_world_size} on this node ({size_var}), but {what} lets each "
            f"process see {visible} GPU{'s' if visible != 1 else ''}, so cuda:{top} ({whose}) "
            "does not exist; every process of the node stops here rather than wait for it.",
            hint="Start at most one process per GPU of the node (--ntasks-per-node, "
            "--nproc-per-node), or give each task its GPUs (srun --gpus-per-task=1).",
        )


def _check(found: Environment, env: Mapping[str, str]) -> Environment:
    rank_var, size_var = launcher_names(found.source)
    if found.world_size < 1 or not 0 <= found.rank < found.world_size:
        raise DistributedError(
            f"rank {found.rank} does not fit in a world of {found.world_size} processes "
            f"({found.source}).",
            hint="Check the launcher's arguments; ranks run from 0 to world size - 1.",
        )
    if not 0 <= found.local_rank < found.local_world_size:
        raise DistributedError(
            f"local rank {found.local_rank} ({rank_var}) does not fit in "
            f"{found.local_world_size} processes per node ({size_var}, {found.source}).",
            hint="Check the launcher's --nproc-per-node (or Slurm's --ntasks-per-node).",
        )
    if not 0 <= found.node_rank < found.num_nodes:
        raise DistributedError(
            f"node {found.node_rank} does not fit in a job of {found.num_nodes} nodes "
            f"({found.source}).",
            hint="Start the job with its launcher from inside the allocation.",
        )
    visible = _visible_count(env)
    if visible is not None:
        check_local_ranks_fit(
            found, visible, f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')}"
        )
    if found.world_size > 1 and (found.master_addr is None or found.master_port is None):
        missing = " and ".join(
            name
            for name, value in (
                ("MASTER_ADDR", found.master_addr),
                ("MASTER_PORT", found.master_port),
            )
            if value is None
        )
        raise DistributedError(
            f"{found.source} started rank {found.rank} of {found.world_size}, but nothing gives "
            f"the rendezvous's {missing}, so the processes cannot find each other.",
            hint=f"Set {missing} (the first node's address and a free port), e.g. "
            "`mpirun -x MASTER_ADDR=node1`; under Slurm, run inside an allocation so that "
            "SLURM_JOB_NODELIST and SLURM_JOB_ID are set.",
        )
    return found


def environment(env: Mapping[str, str] | None = None) -> Environment:
    """Where this process sits in its job, from ``env`` (default ``os.environ``). Pure.

    torchrun's variables win, then Open MPI's, Slurm's (inside an ``srun`` step), SkyPilot's;
    with none of them, rank 0 of 1 on 1 node. Raises :class:`~gpukit.errors.DistributedError`
    naming the variables when they contradict each other (local ranks beyond the GPUs
    CUDA_VISIBLE_DEVICES allows, task counts that do not add up, ranks placed so that none can
    tell where rank 0 runs), which would otherwise hang in the rendezvous.

    >>> e = environment({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
    ...     "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NNODES": "2",
    ...     "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"})
    >>> e.rank, e.local_rank, e.node_rank, e.master_addr, e.master_port, e.source
    (5, 1, 1, 'gpu07', 19242, 'slurm')

    Args:
        env: the variables to read; None: ``os.environ``.
    """
    env = os.environ if env is None else env
    for launcher in _LAUNCHERS:
        if launcher.detect(env):
            found = launcher.read(env)
            return _check(found, env) if found.launched else found
    return SINGLE
