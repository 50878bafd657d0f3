"""``gpukit serve``: Prometheus metrics, JSON and a live dashboard of this machine's GPUs.

Never imports torch. Runs until Ctrl-C or SIGTERM (a systemd stop), then releases its port.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from gpukit.cli._args import Number, Seconds
from gpukit.cli._output import say_if_fake
from gpukit.errors import InvalidArgumentError


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit serve``."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; the page shows user "
        "names and command lines, so serving wider is your explicit choice)",
    )
    parser.add_argument(
        "--port",
        type=Number(0, 65535),
        default=9400,
        help="port to listen on (default 9400; 0: any free one)",
    )
    parser.add_argument(
        "--interval",
        type=Seconds(positive=True),
        default=2.0,
        metavar="SECONDS",
        help="read the GPUs every SECONDS (default 2); requests are answered from the last reading",
    )


def run(args: argparse.Namespace) -> int:
    """Sample the GPUs in the background and serve the last sample until stopped."""
    try:
        from gpukit.serve import DashboardServer, Sampler, is_loopback
    except ImportError as exc:
        raise InvalidArgumentError(
            f"gpukit serve needs {exc.name or 'prometheus_client'}, which is not installed.",
            hint="Install it with pip install 'gpukit[serve]'.",
        ) from exc
    say_if_fake("serve")
    sampler = Sampler(args.interval)
    server = DashboardServer((args.host, args.port), sampler)
    stop = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        sampler.start()
        server.start()
        print(
            f"gpukit serve: serving {server.url} (dashboard; /metrics for Prometheus) "
            f"every {args.interval:g} s. Ctrl-C stops.",
            flush=True,
        )
        if not is_loopback(args.host):
            print(
                f"gpukit serve: listening on {args.host}: anyone who can reach this port sees "
                "the GPUs' user names and command lines.",
                file=sys.stderr,
                flush=True,
            )
        stop.wait()
    finally:
        server.close()
        sampler.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
