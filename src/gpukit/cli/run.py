"""``gpukit run``: pick and claim GPUs (waiting for them if asked), then run a command on them.

    gpukit run -n 2 --wait --timeout 3600 -- python train.py --lr 3e-4

The command runs with ``CUDA_VISIBLE_DEVICES`` set to the chosen GPUs' nvidia-smi indices and
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (so CUDA's numbering matches nvidia-smi's). gpukit stays its
parent and holds the claims until it exits, forwards SIGINT/SIGTERM/SIGHUP sent to gpukit, and
returns its exit status (128+N when a signal N killed it).

The claims belong to gpukit alone: the lock descriptors are close-on-exec, so the command does
not inherit them. Were it to inherit them, a command outliving gpukit (gpukit killed with
SIGKILL, or the command leaving a daemon behind) would keep the GPUs claimed in the name of a
dead process, with nothing to release them. Instead, on Linux the command is asked to stop
(SIGTERM) when gpukit dies, and the claims end with gpukit, at once.

Never imports torch (the command may).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from gpukit.cli._criteria import add_criteria, criteria_from
from gpukit.cli._output import print_error, say_if_fake
from gpukit.errors import ClaimError, GpukitError, InvalidArgumentError, NoDriverError
from gpukit.gpus.claims import Claim, claim, current_claims
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.gpus.select import Criteria, choose
from gpukit.gpus.waiting import wait_and_claim

POLL_VAR = "GPUKIT_POLL_INTERVAL"
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PYTHONS = ("python", "python3")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit run``."""
    add_criteria(parser)
    waiting = parser.add_argument_group("waiting")
    waiting.add_argument("--wait", action="store_true", help="wait in line until the GPUs are free")
    waiting.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="give up after S seconds of waiting: exit 124 (implies --wait)",
    )
    waiting.add_argument(
        "--settle",
        type=int,
        default=3,
        metavar="K",
        help="with --wait, GPUs must qualify K polls in a row, as a neighbour may still be "
        "loading (3)",
    )
    waiting.add_argument(
        "--poll",
        type=float,
        default=float(os.environ.get(POLL_VAR, "2")),
        metavar="S",
        help=f"seconds between polls (2, or ${POLL_VAR})",
    )
    parser.add_argument(
        "--all-gpus",
        action="store_true",
        help="choose among all of the machine's GPUs, not only those CUDA_VISIBLE_DEVICES "
        "(or Slurm's SLURM_JOB_GPUS) grants",
    )
    launch = parser.add_argument_group("launching")
    launch.add_argument(
        "--ddp",
        action="store_true",
        help="run CMD under torchrun, one process per GPU; in a multi-node Slurm or SkyPilot "
        "job (one task per node), join the job's other nodes",
    )
    launch.add_argument(
        "--cpu-ok",
        action="store_true",
        help="without an NVIDIA driver, run CMD on the CPU (CUDA_VISIBLE_DEVICES='') instead "
        "of failing",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...")


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise InvalidArgumentError(
            "gpukit run needs a command to run.", hint="Usage: gpukit run -n 1 -- python train.py"
        )
    return cmd


def ddp_command(cmd: Sequence[str], nproc: int) -> list[str]:
    """``cmd`` under torchrun with ``nproc`` processes on this machine.

    ``python train.py ...`` becomes ``torchrun train.py ...``, ``python -m pkg`` becomes
    ``torchrun -m pkg``, and any other program (``python -u train.py`` included) runs with
    ``--no-python``. On one machine ``--standalone`` gives each job its own rendezvous port, so
    two jobs on one server do not collide; in a multi-node job the options come from
    :func:`gpukit.distributed.torchrun_args` (the job's nodes and a rendezvous derived from it).
    """
    from gpukit.distributed.environment import torchrun_args

    launcher = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(nproc)]
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


class _Status:
    """A live status line on a terminal; plain lines, only when the text changes, in a log."""

    def __init__(self) -> None:
        self.live = sys.stderr.isatty()
        self.last = ""
        self.start = time.monotonic()

    def __call__(self, text: str) -> None:
        if self.live:
            elapsed = int(time.monotonic() - self.start)
            sys.stderr.write(f"\r\033[K{text} [{elapsed // 60}:{elapsed % 60:02d}]")
            sys.stderr.flush()
        elif text != self.last:
            print(f"gpukit run: {text}", file=sys.stderr, flush=True)
        self.last = text

    def done(self, text: str) -> None:
        if self.live and self.last:
            sys.stderr.write("\r\033[K")
        print(f"gpukit run: {text}", file=sys.stderr, flush=True)


def _die_with_parent() -> Callable[[], None]:
    """A function for the child, run between fork and exec: unblock signals, follow gpukit."""
    parent = os.getpid()
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            prctl = None

    def setup() -> None:
        # The blocked-signal mask survives exec: gpukit blocks the forwarded signals to read
        # them synchronously, and the command must receive them as usual.
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        if prctl is not None:
            prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: told to stop when gpukit dies
            if os.getppid() != parent:  # gpukit died before the line above took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return setup


def launch(argv: Sequence[str], env: dict[str, str]) -> int:
    """Run ``argv`` to its end as gpukit's child, forwarding signals; return its exit status.

    A signal a terminal sends (Ctrl-C, hang-up) already reaches the whole foreground process
    group, the command included, so it is not forwarded twice; a signal sent to gpukit alone
    (``kill``, a scheduler) is.
    """
    waited = {*_FORWARDED, signal.SIGCHLD}
    synchronous = hasattr(signal, "sigtimedwait")
    if synchronous:
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    try:
        proc = subprocess.Popen(list(argv), env=env, preexec_fn=_die_with_parent())
    except OSError as exc:  # not found, not executable (chmod), a folder, not a program
        if synchronous:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if isinstance(exc, FileNotFoundError):
            raise InvalidArgumentError(
                f"Cannot run {argv[0]!r}: no such program.", hint="Check the command after `--`."
            ) from exc
        raise InvalidArgumentError(
            f"Cannot run {argv[0]!r}: {exc.strerror or exc}.",
            hint="Check the command after `--`: make the file executable (chmod +x) or run it "
            "with its interpreter, e.g. `-- python train.py`.",
        ) from exc
    if not synchronous:  # platforms without sigtimedwait: forward everything we receive
        for signum in _FORWARDED:
            signal.signal(signum, lambda s, _f: proc.send_signal(s))
        return _status(proc.wait())
    try:
        while True:
            info = signal.sigtimedwait(waited, 0.25)
            if info is not None and info.si_signo != signal.SIGCHLD and info.si_pid != 0:
                proc.send_signal(info.si_signo)
            code = proc.poll()
            if code is not None:
                return _status(code)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _cpu_only(args: argparse.Namespace, cmd: list[str], reason: NoDriverError) -> int:
    print(
        f"gpukit run: {reason.message} --cpu-ok: running the command on the CPU "
        "(CUDA_VISIBLE_DEVICES='').",
        file=sys.stderr,
        flush=True,
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return launch(ddp_command(cmd, args.gpus) if args.ddp else cmd, env)


def run(args: argparse.Namespace) -> int:
    """Pick, claim (waiting if asked), run the command, return its exit status."""
    cmd = _command(args)
    criteria = criteria_from(args)
    if args.settle < 1 or args.poll <= 0:
        raise InvalidArgumentError(
            f"--settle {args.settle} --poll {args.poll}: both must be positive.",
            hint="Use e.g. --settle 3 --poll 2.",
        )
    if args.timeout is not None and not args.timeout >= 0:  # also refuses nan
        raise InvalidArgumentError(
            f"--timeout {args.timeout:g} is not a number of seconds to wait.",
            hint="Use 0 or more, e.g. --timeout 3600; leave it out to wait as long as it takes.",
        )
    say_if_fake("run")
    try:
        inv = inventory()
    except NoDriverError as exc:
        if args.cpu_ok:
            return _cpu_only(args, cmd, exc)
        raise
    label = shlex.join(cmd)
    held: Claim
    try:
        waits = args.wait or args.timeout is not None
        if not args.all_gpus:
            inv, criteria = _granted_only(inv, args.gpus, criteria, waits)
        if waits:
            status = _Status()
            held = wait_and_claim(
                args.gpus,
                criteria,
                order=args.order,
                timeout=args.timeout,
                settle=args.settle,
                poll=args.poll,
                command=label,
                on_status=status,
            )
            status.done(f"claimed GPU {','.join(map(str, held.indices))}.")
        else:
            held = _claim_now(args, criteria, inv, label)
    except GpukitError as exc:
        return print_error("run", exc)
    with held:
        visible = ",".join(str(i) for i in held.indices)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        return launch(ddp_command(cmd, args.gpus) if args.ddp else cmd, env)


def _granted_only(
    inv: Inventory, n: int, criteria: Criteria, waits: bool
) -> tuple[Inventory, Criteria]:
    """Only the GPUs CUDA_VISIBLE_DEVICES (or Slurm) granted: the inventory cut to them, or,
    for waiting (which reads the machine on each poll), criteria that exclude the others."""
    from dataclasses import replace

    from gpukit.gpus.visible import granted_inventory

    granted = granted_inventory(inv, n)
    others = tuple(g.uuid for g in inv.gpus if g not in granted.gpus)
    if not waits or not others:
        return granted, criteria
    return inv, replace(criteria, exclude=criteria.exclude + others)


def _claim_now(args: argparse.Namespace, criteria: Criteria, inv: Inventory, label: str) -> Claim:
    # Another process may claim a GPU between reading the claims and locking: read again.
    for attempt in range(3):
        gpus = choose(inv, args.gpus, criteria, order=args.order, claims=current_claims())
        try:
            return claim(gpus, command=label)
        except ClaimError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")
