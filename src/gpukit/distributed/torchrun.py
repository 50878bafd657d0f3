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

import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpukit.distributed.environment import (
    environment,
    launcher_names,
    slurm_allocation_nodes,
)
from gpukit.errors import DistributedError, InvalidArgumentError
from gpukit.supervise import FORWARDED, check_program
from gpukit.untrusted import MAX_SECONDS

__all__ = [
    "AGENT",
    "RESTART_STORE_VAR",
    "SIGNALS_VAR",
    "check_ddp_program",
    "ddp_command",
    "ddp_env",
    "torchrun_args",
]

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

    Args:
        nproc_per_node: the processes to start on this node, 1 or more.
        env: the job's variables; None: ``os.environ``.
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


_WHOLE = re.compile(r"[+-]?[0-9]{1,18}")
_REAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _number(text: str, *, whole: bool) -> float | None:
    """``text`` as a finite number written in ASCII digits (a whole one if ``whole``), else
    ``None``: torchrun's own int() and float() take "nan", "inf" and other scripts' digits."""
    if whole:
        return int(text) if _WHOLE.fullmatch(text) else None
    if len(text) > 64 or not _REAL.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class _NumberOption:
    """One of torchrun's options that take a number, and the numbers gpukit passes on to it.

    torchrun checks few of them itself, and those with a traceback: a negative
    ``--max-restarts`` fails an assertion, ``--monitor-interval=nan`` fails its first sleep,
    after the workers have started.
    """

    names: tuple[str, ...]  # every spelling torchrun takes
    what: str  # what it accepts, as the error says it
    example: str
    low: float
    high: float
    whole: bool = True
    positive: bool = False  # above ``low`` (0), not at it
    span: bool = False  # N or MIN:MAX (--nnodes)

    @property
    def variable(self) -> str:
        """The variable torchrun reads the option from when it is not given (``PET_...``)."""
        return "PET_" + self.names[0][2:].replace("-", "_").upper()

    def accepts(self, text: str) -> bool:
        """Whether ``text`` is a value this option takes."""
        values = []
        for part in text.split(":", 1) if self.span else [text]:
            value = _number(part, whole=self.whole)
            if value is None or not self.low <= value <= self.high:
                return False
            if self.positive and value == self.low:
                return False
            values.append(value)
        return values == sorted(values)  # MIN:MAX, not MAX:MIN


_NUMBER_OPTIONS = (
    _NumberOption(
        ("--max-restarts", "--max_restarts"), "a whole number from 0 to 10,000", "3", 0, 10_000
    ),
    _NumberOption(
        ("--monitor-interval", "--monitor_interval"),
        "a number of seconds above 0, at most a year",
        "0.5",
        0,
        MAX_SECONDS,
        whole=False,
        positive=True,
    ),
    _NumberOption(
        ("--shutdown-timeout", "--shutdown_timeout"),
        f"a whole number of seconds from 0 to a year ({int(MAX_SECONDS):,})",
        "30",
        0,
        MAX_SECONDS,
    ),
    _NumberOption(
        ("--nnodes",),
        "a node count from 1 to 100,000, or a range MIN:MAX of them such as 1:4",
        "1:4",
        1,
        100_000,
        span=True,
    ),
    _NumberOption(
        ("--node-rank", "--node_rank"), "a whole number from 0 to 100,000", "0", 0, 100_000
    ),
    _NumberOption(
        ("--master-port", "--master_port"), "a port number from 1 to 65,535", "29500", 1, 65_535
    ),
)
_NUMBER_OPTION = {name: option for option in _NUMBER_OPTIONS for name in option.names}


def _check_number(option: str, given: set[_NumberOption]) -> None:
    """Refuse ``option`` (one ``--torchrun-arg``) if it gives torchrun a number it cannot take;
    add the number option it sets to ``given``."""
    name, eq, value = option.partition("=")
    known = _NUMBER_OPTION.get(name)
    if known is None:
        # torchrun takes any unambiguous start of an option's name: --max-rest=-1 is
        # --max-restarts=-1, which would pass unchecked. (A start that is also another
        # option's, torchrun refuses as ambiguous.)
        meant = [
            o.names[0]
            for o in _NUMBER_OPTIONS
            if len(name) > 2 and any(n.startswith(name) for n in o.names)
        ]
        if meant:
            raise InvalidArgumentError(
                f"--torchrun-arg={option}: write its whole name, {' or '.join(meant)}.",
                hint="gpukit checks the values of torchrun's options by their whole names, "
                f"e.g. --torchrun-arg={meant[0]}={_NUMBER_OPTION[meant[0]].example}.",
            )
        return
    given.add(known)
    if not eq:  # torchrun would take the next word, the command's, as its value
        raise InvalidArgumentError(
            f"--torchrun-arg={option} takes its value after '='.",
            hint=f"Write it as one option: --torchrun-arg={name}={known.example}.",
        )
    if not known.accepts(value):
        raise InvalidArgumentError(
            f"--torchrun-arg={option}: {value!r} is not {known.what}.",
            hint=f"Write it as, e.g., --torchrun-arg={name}={known.example}.",
        )


def _check_torchrun_options(
    options: Sequence[str], own: Sequence[str], env: Mapping[str, str]
) -> None:
    """Refuse what torchrun would refuse with a traceback, or would run other than asked.

    ``options`` are the user's (``--torchrun-arg``), ``own`` those gpukit gives; a number
    option that neither gives is read by torchrun from its ``PET_`` variable in ``env``.
    """
    given: set[_NumberOption] = set()
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
        _check_number(option, given)
    given.update(o for o in _NUMBER_OPTIONS if any(a.partition("=")[0] in o.names for a in own))
    for known in _NUMBER_OPTIONS:
        value = env.get(known.variable)
        if known not in given and value is not None and not known.accepts(value):
            raise InvalidArgumentError(
                f"{known.variable}={value!r} (torchrun's {known.names[0]}, from the "
                f"environment) is not {known.what}.",
                hint=f"Unset it, or set it as, e.g., {known.variable}={known.example}.",
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


def ddp_command(
    cmd: Sequence[str],
    nproc: int,
    options: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> list[str]:
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

    The numbers torchrun's options take (``--max-restarts``, ``--monitor-interval``,
    ``--shutdown-timeout``, ``--nnodes``, ``--node-rank``, ``--master-port``) are checked
    here, whether in ``options`` or in torchrun's ``PET_`` variables of ``env`` (default: this
    process's environment), since torchrun answers a wrong one with a traceback, some only
    after its workers have started.

    Raises:
        InvalidArgumentError: an option is not one torchrun option, sets the process count, or
            gives a number option a value it cannot take (or abbreviates its name).
        DistributedError: the job cannot run this way (see :func:`torchrun_args`).
    """
    env = os.environ if env is None else env
    own = torchrun_args(nproc, env)
    _check_torchrun_options(options, own, env)
    return [sys.executable, "-m", AGENT, *own, *options, *_target(cmd)]


def _target(cmd: Sequence[str]) -> list[str]:
    """What torchrun runs, after its options: a script, ``-m`` and a module, or
    ``--no-python`` and a program, each with its arguments."""
    program = os.path.basename(cmd[0])
    # torchrun takes the script or -m, not python's own options (python -u train.py): with
    # those, it runs the whole python command line as a program instead.
    if program.startswith(_PYTHONS) and len(cmd) > 1 and not cmd[1].startswith("-"):
        return list(cmd[1:])
    if program.startswith(_PYTHONS) and len(cmd) > 2 and cmd[1] == "-m":
        return list(cmd[1:])
    if program.endswith(".py"):
        return list(cmd)
    return ["--no-python", *cmd]


def check_ddp_program(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Refuse, before torchrun starts, a command :func:`ddp_command` makes its workers run that
    they could not start: torchrun would answer with a traceback, once per attempt.

    A program (``--no-python``) is looked up as :func:`gpukit.supervise.check_program` looks
    it up, in ``env``'s ``PATH`` (default: this process's environment); a script must exist
    (a file, or a folder or zip file Python runs); a module (``-m``) is left to Python.

    Raises:
        InvalidArgumentError: the program or script cannot be started, saying why.
    """
    target = _target(cmd)
    if target[0] == "--no-python":
        check_program(target[1], os.environ if env is None else env)
    elif target[0] != "-m" and not os.path.exists(target[0]):
        raise InvalidArgumentError(
            f"Cannot run {target[0]!r}: no such file.", hint="Check the command after `--`."
        )
