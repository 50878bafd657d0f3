"""``gpukit run``: pick and claim GPUs (waiting for them if asked), then run a command on them.

    gpukit run -n 2 --wait --timeout 3600 -- python train.py --lr 3e-4

The command runs with ``CUDA_VISIBLE_DEVICES`` set to the chosen GPUs' nvidia-smi indices and
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (so CUDA's numbering matches nvidia-smi's). gpukit stays its
parent and holds the claims until it exits, passes every signal on to it exactly once (see
:mod:`gpukit.supervise`), and returns its exit status (128+N when a signal N killed it). Under
``--ddp`` that is the workers' status: 75 when they stopped for preemption, else the code of
the first worker that failed (:mod:`gpukit.distributed.torchrun_agent`).

A process the command leaves behind (``cmd &``, torchrun's workers when torchrun is killed)
becomes gpukit's child (gpukit is their subreaper), and the claims last until it has ended too.

The claims belong to gpukit alone: the lock descriptors are close-on-exec, so the command does
not inherit them. Were it to inherit them, a command outliving gpukit (gpukit killed with
SIGKILL) would keep the GPUs claimed in the name of a dead process, with nothing to release
them. Instead, on Linux the command is asked to stop
(SIGTERM) when gpukit dies, and the claims end with gpukit, at once.

Never imports torch (the command may).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time

from gpukit.cli._args import Number, Seconds
from gpukit.cli._criteria import add_criteria, criteria_from
from gpukit.cli._output import print_error, say_if_fake
from gpukit.distributed.torchrun import check_ddp_program, ddp_command, ddp_env
from gpukit.errors import DistributedError, GpukitError, InvalidArgumentError, NoDriverError
from gpukit.gpus.inventory import inventory
from gpukit.sharing.acquire import POLL_VAR, GpuRequest, acquire_request, poll_interval
from gpukit.sharing.lock_folder import lock_folder
from gpukit.sharing.policy import load_policy
from gpukit.supervise import supervise


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit run``."""
    add_criteria(parser)
    waiting = parser.add_argument_group("waiting")
    waiting.add_argument("--wait", action="store_true", help="wait in line until the GPUs are free")
    waiting.add_argument(
        "--timeout",
        type=Seconds(),
        metavar="S",
        help="give up after S seconds of waiting: exit 124 (implies --wait)",
    )
    waiting.add_argument(
        "--settle",
        type=Number(1, 1_000_000),
        default=3,
        metavar="K",
        help="with --wait, GPUs must qualify K polls in a row, as a neighbour may still be "
        "loading (3)",
    )
    waiting.add_argument(
        "--poll",
        type=Seconds(positive=True),
        default=None,
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
        "--torchrun-arg",
        action="append",
        default=[],
        metavar="OPT",
        help="with --ddp, give torchrun the option OPT, after gpukit's own (so it wins); "
        "repeat it, one option each, written --name=value: --torchrun-arg=--max-restarts=3 "
        "--torchrun-arg=--nnodes=1:4. With restarts, gpukit sets "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which they fail",
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


class _Status:
    """A live status line on a terminal; plain lines, only when the text changes, in a log."""

    def __init__(self) -> None:
        self.live = sys.stderr.isatty()
        self.last = ""
        self.start = time.monotonic()

    def __call__(self, text: str) -> None:
        if self.live:
            elapsed = int(time.monotonic() - self.start)
            clock = f" [{elapsed // 60}:{elapsed % 60:02d}]"
            sys.stderr.write(f"\r\033[K{_fit(text, _columns() - 1 - len(clock))}{clock}")
            sys.stderr.flush()
        elif text != self.last:
            print(f"gpukit run: {text}", file=sys.stderr, flush=True)
        self.last = text

    def clear(self) -> None:
        """Wipe the live line (before an error is printed)."""
        if self.live and self.last:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.last = ""

    def done(self, text: str) -> None:
        self.clear()
        print(f"gpukit run: {text}", file=sys.stderr, flush=True)


def _columns() -> int:
    """The terminal's width (``$COLUMNS`` first, as for every terminal program; else 80)."""
    return shutil.get_terminal_size((80, 24)).columns


def _fit(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, cut in the middle: its start says what is
    waited for, its end how many GPUs qualify. A live line longer than the terminal wraps,
    and rewriting it in place then leaves the rows above it on the screen."""
    if len(text) <= width:
        return text
    if width < 5:
        return text[: max(width, 0)]
    head = (width - 3) // 3  # "..." and not an ellipsis character: any terminal shows it
    return f"{text[:head]}...{text[len(text) - (width - 3 - head) :]}"


def _say_leftovers(pids: list[int]) -> None:
    listed = " ".join(map(str, pids[:10])) + (" ..." if len(pids) > 10 else "")
    print(
        f"gpukit run: the command has ended, but {len(pids)} process"
        f"{'es' if len(pids) != 1 else ''} it started still run{'s' if len(pids) == 1 else ''} "
        f"(pid {listed}): the GPUs stay claimed until they end (Ctrl-C, or kill, passes on).",
        file=sys.stderr,
        flush=True,
    )


def _cpu_only(args: argparse.Namespace, argv: list[str]) -> int:
    """Run on the CPU, as --cpu-ok asks where no driver is: one line says so, nothing more."""
    print(
        "gpukit run: no NVIDIA driver; running on the CPU (--cpu-ok, CUDA_VISIBLE_DEVICES='').",
        file=sys.stderr,
        flush=True,
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    if args.ddp and args.gpus > 1:
        # torchrun's own choice for several processes, made here so that it prints no banner.
        env.setdefault("OMP_NUM_THREADS", "1")
    return supervise(
        argv, ddp_env(args.torchrun_arg, env) if args.ddp else env, on_leftovers=_say_leftovers
    )


def _request(args: argparse.Namespace) -> GpuRequest:
    """The request the options make, checked once: every option's mistake, before anything is
    read."""
    if args.poll is not None:
        poll_interval()  # a bad $GPUKIT_POLL_INTERVAL is refused by every run, --poll or not
    return GpuRequest(
        args.gpus,
        criteria_from(args),
        order=args.order,
        wait=args.wait,
        timeout=args.timeout,
        poll=args.poll,
        settle=args.settle,
        all_gpus=args.all_gpus,
    )


def run(args: argparse.Namespace) -> int:
    """Pick, claim (waiting if asked), run the command, return its exit status."""
    cmd = _command(args)
    request = _request(args)
    if args.torchrun_arg and not args.ddp:
        raise InvalidArgumentError(
            f"--torchrun-arg={args.torchrun_arg[0]} without --ddp: no torchrun to give it to.",
            hint="Add --ddp: gpukit run --ddp -n N --torchrun-arg=OPT -- train.py",
        )
    # Under --ddp, a job that cannot work this way is refused before any GPU is claimed, and
    # so is a command torchrun's workers could not start (without --ddp, starting it tells).
    try:
        argv = ddp_command(cmd, args.gpus, args.torchrun_arg) if args.ddp else cmd
    except DistributedError as exc:  # the job, as the command line places it: a usage error
        raise InvalidArgumentError(exc.message, hint=exc.hint) from exc
    if args.ddp:
        check_ddp_program(cmd)
    say_if_fake("run")
    try:
        machine = inventory()
    except NoDriverError as exc:
        if args.cpu_ok:
            return _cpu_only(args, argv)
        cpu = "run the command on the CPU instead: add --cpu-ok " + (
            "(gpukit run --ddp --cpu-ok -n N -- CMD)."
            if args.ddp
            else "(gpukit run --cpu-ok -- CMD)."
        )
        raise NoDriverError(
            exc.message, hint=f"{exc.hint} Or {cpu}" if exc.hint else cpu.capitalize()
        ) from exc
    folder = lock_folder()
    policy = load_policy(folder)
    # A co-user's policy.toml: not a policy, but the administrator may want to know.
    if policy.ignored:
        print(f"gpukit run: warning: {policy.ignored}", file=sys.stderr)
    waits = request.wait
    status = _Status()
    try:
        held = acquire_request(
            request,
            machine,
            folder=folder,
            policy=policy,
            command=shlex.join(cmd),
            on_status=status,
        )
    except GpukitError as exc:
        if waits:
            status.clear()
        return print_error("run", exc)
    if waits:
        status.done(f"claimed GPU {','.join(map(str, held.indices))}.")
    with held:
        visible = ",".join(str(i) for i in held.indices)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        code = supervise(
            argv,
            ddp_env(args.torchrun_arg, env) if args.ddp else env,
            on_leftovers=_say_leftovers,
        )
        held.release(exit_code=code)  # the ledger records how the command ended
        return code
