"""torchrun's options for ``gpukit run --ddp``: one torchrun per node, joined as the job says.

Where the job is (:func:`~gpukit.distributed.environment.environment`) decides what torchrun is
told: ``--standalone`` on one node, else the job's node count and a c10d rendezvous on its first
node, at a port derived from the job, so no address is exported by hand. Launches that would
start a torchrun per task, or torchrun inside torchrun, are refused here, before anything runs.

:func:`ddp_command` and :func:`ddp_env` make ``gpukit run --ddp``'s whole torchrun command and
its environment. torchrun passes on to its workers (each in a session of its own, which no
signal to torchrun's group reaches) only the signals named in its ``--signals-to-handle``;
torch's default leaves out SIGUSR1 and SIGUSR2, and one of those, Slurm's usual "save now"
(``--signal=USR1@90``), killed torchrun and left its workers running without it. gpukit names
every signal it forwards (:data:`gpukit.supervise.FORWARDED`), so each reaches every worker and
torchrun lives until they end: after passing a signal on it waits for its workers
(``--shutdown-timeout``, 30 seconds unless told otherwise) and only then kills the ones left;
a second signal meanwhile (Slurm's copy of the one gpukit forwards) is passed on too, instead of
cutting that wait short (:mod:`gpukit.distributed.torchrun_agent`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from gpukit.distributed.environment import (
    environment,
    launcher_names,
    slurm_allocation_nodes,
)
from gpukit.errors import DistributedError, InvalidArgumentError
from gpukit.supervise import FORWARDED

__all__ = ["AGENT", "RESTART_STORE_VAR", "SIGNALS_VAR", "ddp_command", "ddp_env", "torchrun_args"]

_PYTHONS = ("python", "python3")
AGENT = "gpukit.distributed.torchrun_agent"
"""The module ``gpukit run --ddp`` runs as torchrun: torchrun, made to act on one signal and
pass the later ones on (see :mod:`gpukit.distributed.torchrun_agent`)."""


def torchrun_args(nproc_per_node: int, env: Mapping[str, str] | None = None) -> list[str]:
    """torchrun's options for this node of the job: nodes, node rank, processes, rendezvous.

    Run once per node (``srun --ntasks-per-node=1``, or SkyPilot's ``run:``): every node gets
    the same c10d rendezvous on the job's first node, at a port and with an id derived from
    the job, so no address is exported by hand. Outside a multi-node job it is
    ``--standalone`` (a rendezvous of its own on this machine). Several tasks on one node are
    refused (each would start its own torchrun), on one node as on several.

    >>> torchrun_args(4, {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
    ...     "SKYPILOT_NODE_IPS": "10.0.0.5\\n10.0.0.6", "MASTER_PORT": "29400"})
    ['--nnodes=2', '--nproc-per-node=4', '--rdzv-backend=c10d', \
'--rdzv-endpoint=10.0.0.5:29400', '--rdzv-id=gpukit-29400']
    """
    if (
        isinstance(nproc_per_node, bool)
        or not isinstance(nproc_per_node, int)
        or nproc_per_node < 1
    ):
        raise DistributedError(
            f"torchrun_args() was asked for nproc_per_node={nproc_per_node!r}.",
            hint="Pass the number of processes to start on this node, e.g. its GPU count.",
        )
    found = environment(env)
    if found.source == "torchrun":
        raise DistributedError(
            f"This process already runs under torchrun (rank {found.rank} of "
            f"{found.world_size}): starting torchrun again would nest two process groups.",
            hint="Run `gpukit run --ddp` from the job script or srun, not from a training worker.",
        )
    env = os.environ if env is None else env
    nodes = slurm_allocation_nodes(env)
    if found.source is None and env.get("SLURM_JOB_ID") and nodes > 1:
        raise DistributedError(
            f"This runs in Slurm job {env['SLURM_JOB_ID']}'s script, outside any srun step, so "
            f"it would start torchrun on 1 of the job's {nodes} nodes.",
            hint="Start it on every node: `srun --ntasks-per-node=1 gpukit run --ddp -n N -- "
            "train.py` (or `srun -N1 ...` to use one node on purpose).",
        )
    if found.local_world_size != 1:
        # Checked before the one-node case: srun -N1 -n2 would otherwise start two standalone
        # torchruns, two separate trainings (and, on a GPU node, two claims).
        _, size_var = launcher_names(found.source)
        processes = f"{nproc_per_node} process{'es' if nproc_per_node != 1 else ''}"
        raise DistributedError(
            f"{found.source} started {found.local_world_size} tasks on this node ({size_var}), "
            f"but torchrun starts the node's {processes} itself: each task would start its own "
            "torchrun, and its own training.",
            hint="Start one task per node: `srun --ntasks-per-node=1 gpukit run --ddp -n N -- "
            "train.py`.",
        )
    if found.num_nodes <= 1:
        return ["--standalone", f"--nproc-per-node={nproc_per_node}"]
    # _check refused a multi-node job without a rendezvous address and port.
    assert found.master_addr is not None
    assert found.master_port is not None
    run_id = found.job_id or f"gpukit-{found.master_port}"
    # No --node-rank: the c10d rendezvous numbers the nodes itself (torchrun ignores it, and
    # says so).
    return [
        f"--nnodes={found.num_nodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={found.master_addr}:{found.master_port}",
        f"--rdzv-id={run_id}",
    ]


# torchrun's options that gpukit decides: the processes are the GPUs it claimed (-n).
_GPUKIT_DECIDES = ("--nproc-per-node", "--nproc_per_node")
_RESTARTS = ("--max-restarts", "--max_restarts")
RESTART_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set for torchrun when restarts are asked for: with the rendezvous's TCP store shared with
the workers (torch's default), a restarted gloo group fails or hangs."""


def _check_torchrun_options(options: Sequence[str]) -> None:
    for option in options:
        name = option.partition("=")[0]
        if not option.startswith("-"):
            raise InvalidArgumentError(
                f"--torchrun-arg={option!r} is not a torchrun option.",
                hint="Give one option each, with its value after '=': "
                "--torchrun-arg=--max-restarts=3; the command goes after `--`.",
            )
        if name in _GPUKIT_DECIDES:
            raise InvalidArgumentError(
                f"--torchrun-arg={option}: gpukit starts one process per GPU it claims.",
                hint="Ask for the GPUs with -n N instead: gpukit run --ddp -n N -- train.py",
            )


def _restarts(options: Sequence[str], env: Mapping[str, str]) -> bool:
    """True when torchrun is asked to restart failed workers (``--max-restarts``, ``$PET_``)."""
    asked = env.get("PET_MAX_RESTARTS", "")
    for i, option in enumerate(options):
        name, eq, value = option.partition("=")
        if name in _RESTARTS:
            asked = value if eq else (options[i + 1] if i + 1 < len(options) else "")
    return asked.strip().isdigit() and int(asked) > 0


SIGNALS_VAR = "PET_SIGNALS_TO_HANDLE"
"""torchrun's ``--signals-to-handle`` as its environment gives it: a torch that has no such
option ignores the variable, where the option itself would stop it with a usage error."""


def ddp_env(options: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """The environment torchrun runs in: ``env``, the signals it must pass on to its workers
    (every one gpukit forwards), and what its restarts need when asked for. A value the user
    set wins, and so does ``--torchrun-arg=--signals-to-handle=...``.

    >>> ddp_env([], {})["PET_SIGNALS_TO_HANDLE"]
    'SIGINT,SIGTERM,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2'
    """
    ours = {SIGNALS_VAR: ",".join(s.name for s in FORWARDED)}
    if _restarts(options, env):
        ours[RESTART_STORE_VAR] = "1"
    return {**ours, **env}


def ddp_command(cmd: Sequence[str], nproc: int, options: Sequence[str] = ()) -> list[str]:
    """``cmd`` under torchrun with ``nproc`` processes on this machine.

    ``python train.py ...`` becomes ``torchrun train.py ...`` (torchrun being
    :data:`AGENT`), ``python -m pkg`` becomes
    ``torchrun -m pkg``, and any other program (``python -u train.py`` included) runs with
    ``--no-python``. On one machine ``--standalone`` gives each job its own rendezvous port, so
    two jobs on one server do not collide; in a multi-node job the options come from
    :func:`gpukit.distributed.torchrun_args` (the job's nodes and a rendezvous derived from it).
    ``options`` (``--torchrun-arg``) follow gpukit's, so that they win. A job that cannot work
    this way (several tasks on one node, the batch script of a multi-node job) is a usage
    error, with the command that works in its hint.

    Raises:
        InvalidArgumentError: an option is not one torchrun option, or sets the process count.
        DistributedError: the job cannot run this way (see :func:`torchrun_args`).
    """
    _check_torchrun_options(options)
    launcher = [sys.executable, "-m", AGENT, *torchrun_args(nproc), *options]
    program = os.path.basename(cmd[0])
    # torchrun takes the script or -m, not python's own options (python -u train.py): with
    # those, it runs the whole python command line as a program instead.
    if program.startswith(_PYTHONS) and len(cmd) > 1 and not cmd[1].startswith("-"):
        return [*launcher, *cmd[1:]]
    if program.startswith(_PYTHONS) and len(cmd) > 2 and cmd[1] == "-m":
        return [*launcher, *cmd[1:]]
    if program.endswith(".py"):
        return [*launcher, *cmd]
    return [*launcher, "--no-python", *cmd]
