"""``gpukit serve`` and ``gpukit list --hosts`` on a fake 8-GPU machine.

- A Prometheus scrape of ``/metrics`` (HTTP over loopback, answered from the last sample)
  against reading NVML and rendering at scrape time, as an exporter without a sampler does.
- ``list --hosts`` over 8 fake hosts (a fake ssh that runs this gpukit on the fake machine)
  against asking the same 8 hosts one after another.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

from gpukit.bench.core import BenchResult, compare
from gpukit.bench.startup import _fake_machine

SUITE = "serve"
_HOSTS = 8


def applies() -> str | None:
    """Why the suite cannot run here, or None when it can."""
    import importlib.util

    if importlib.util.find_spec("prometheus_client") is None:
        return "needs prometheus_client (pip install 'gpukit[serve]')"
    return None


def _scrape(url: str) -> Callable[[], bytes]:
    def get() -> bytes:
        with urllib.request.urlopen(url, timeout=30) as answer:
            body: bytes = answer.read()
            return body

    return get


def _scrape_results(quick: bool) -> list[BenchResult]:
    from gpukit.gpus.inventory import inventory
    from gpukit.serve import DashboardServer, Sampler
    from gpukit.serve.metrics import exposition
    from gpukit.sharing.report import sharing

    def on_demand() -> bytes:
        inv = inventory()
        return exposition(inv, sharing(inv, observe=False))

    sampler = Sampler(3600)
    sampler.start()
    server = DashboardServer(("127.0.0.1", 0), sampler)
    server.start()
    try:
        times = compare(
            {
                "scrape": _scrape(server.url + "metrics"),
                "on demand": on_demand,
            },
            repeat=5 if quick else 31,
            number=1 if quick else 5,
        )
    finally:
        server.close()
        sampler.stop()
    return [
        BenchResult(
            suite=SUITE,
            name="GET /metrics, 8 GPUs (from the last sample)",
            value=times["scrape"] * 1000,
            unit="ms",
            baseline_name="read NVML + render at scrape time, no HTTP",
            baseline_value=times["on demand"] * 1000,
            target="< 50 ms",
            target_value=50.0,
        )
    ]


def _fake_hosts(folder: Path, machine: Path) -> str:
    """A fake ssh whose every host runs this gpukit on ``machine``; returns its command line."""
    shim = folder / "bin" / "gpukit"
    shim.parent.mkdir()
    src = str(Path(__file__).resolve().parents[2])
    shim.write_text(
        "#!/bin/sh\n"
        f"exec env PYTHONPATH={shlex.quote(src)} GPUKIT_FAKE_NVML={shlex.quote(str(machine))} "
        f'{shlex.quote(sys.executable)} -m gpukit "$@"\n'
    )
    ssh = folder / "fake-ssh"
    ssh.write_text(
        "#!/bin/sh\n"
        'while [ "$#" -gt 2 ]; do shift; done\n'
        f'exec env PATH={shlex.quote(str(shim.parent))}:"$PATH" sh -c "$2"\n'
    )
    shim.chmod(0o755)
    ssh.chmod(0o755)
    return shlex.quote(str(ssh))


def _hosts_results(quick: bool) -> list[BenchResult]:
    from gpukit.gpus.hosts import read_hosts

    hosts = [f"gpu{i}" for i in range(_HOSTS)]
    with tempfile.TemporaryDirectory() as tmp:
        ssh = _fake_hosts(Path(tmp), _fake_machine(Path(tmp)))

        def together() -> None:
            readings = read_hosts(hosts, timeout=60, ssh_command_text=ssh)
            failed = [r.error for r in readings if r.error]
            if failed:
                raise RuntimeError(f"a fake host failed: {failed[0]}")

        def one_by_one() -> None:
            for host in hosts:
                read_hosts([host], timeout=60, ssh_command_text=ssh)

        times = compare(
            {"together": together, "one by one": one_by_one},
            repeat=1 if quick else 5,
            warmup=0 if quick else 1,
        )
    return [
        BenchResult(
            suite=SUITE,
            name=f"list --hosts, {_HOSTS} fake hosts (8 GPUs each)",
            value=times["together"],
            unit="s",
            baseline_name="the same hosts one after another",
            baseline_value=times["one by one"],
            target="< 2 s",
            target_value=2.0,
            note=f"{os.cpu_count()} CPUs run the {_HOSTS} fake hosts' gpukit processes",
        )
    ]


def run(quick: bool = False) -> list[BenchResult]:
    """A scrape of /metrics and a read of 8 hosts, each against its alternative."""
    previous = os.environ.get("GPUKIT_FAKE_NVML")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["GPUKIT_FAKE_NVML"] = str(_fake_machine(Path(tmp)))
        try:
            results = _scrape_results(quick)
        finally:
            if previous is None:
                os.environ.pop("GPUKIT_FAKE_NVML", None)
            else:
                os.environ["GPUKIT_FAKE_NVML"] = previous
    return results + _hosts_results(quick)
