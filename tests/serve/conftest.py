"""A dashboard server in this process, on a port the OS chooses, reading a copy of a machine."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpukit.serve import DashboardServer, Sampler
from tests.helpers import MACHINES


@dataclass
class Served:
    server: DashboardServer
    sampler: Sampler
    machine: Path
    """A copy of the machine description: edit it with :meth:`edit`, then call ``sample()``."""

    @property
    def url(self) -> str:
        return self.server.url

    def edit(self, gpu: int, **readings: Any) -> None:
        data = json.loads(self.machine.read_text())
        data["gpus"][gpu].update(readings)
        self.machine.write_text(json.dumps(data))


@pytest.fixture
def serve_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``serve_machine(name, interval=...)`` starts a server; every one is closed at the end."""
    started: list[Served] = []
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(tmp_path / "locks"))

    def start(name: str = "server-8xA100-shared", interval: float = 3600.0) -> Served:
        machine = tmp_path / f"{name}.json"
        shutil.copy(MACHINES / f"{name}.json", machine)
        monkeypatch.setenv("GPUKIT_FAKE_NVML", str(machine))
        sampler = Sampler(interval)
        sampler.start()
        server = DashboardServer(("127.0.0.1", 0), sampler)
        server.start()
        started.append(Served(server, sampler, machine))
        return started[-1]

    yield start
    for served in started:
        served.server.close()
        served.sampler.stop()
