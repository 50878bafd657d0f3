"""Fake machines reachable through a fake ssh: gpukit hosts, nvidia-smi hosts, dead hosts."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from tests.helpers import MACHINES, ROOT

FAKE_SSH = ROOT / "tests" / "fixtures" / "ssh" / "fake-ssh"
NVIDIA_SMI_CSV = ROOT / "tests" / "fixtures" / "ssh" / "nvidia-smi-2xT4.csv"


class FakeHosts:
    """Hosts as folders under ``root``; ``ssh`` is the command line that reaches them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.ssh = f"env FAKE_SSH_HOSTS={shlex.quote(str(root))} {shlex.quote(str(FAKE_SSH))}"

    def _bin(self, host: str, name: str, body: str) -> None:
        folder = self.root / host / "bin"
        folder.mkdir(parents=True, exist_ok=True)
        script = folder / name
        script.write_text("#!/bin/sh\n" + body)
        script.chmod(0o755)

    def gpukit(self, host: str, machine: str = "server-8xA100-shared") -> None:
        """A host with gpukit installed, whose NVML is the fake ``machine``."""
        env = {
            "PYTHONPATH": str(ROOT / "src"),
            "GPUKIT_FAKE_NVML": str(MACHINES / f"{machine}.json"),
            "GPUKIT_LOCK_DIR": str(self.root / host / "locks"),
        }
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        self._bin(
            host, "gpukit", f'exec env {assigns} {shlex.quote(sys.executable)} -m gpukit "$@"\n'
        )

    def nvidia_smi(self, host: str, csv: Path = NVIDIA_SMI_CSV) -> None:
        """A host with the driver's nvidia-smi but no gpukit."""
        self._bin(host, "nvidia-smi", f"exec cat {shlex.quote(str(csv))}\n")

    def answering(self, host: str, answer: str | bytes, via: str = "gpukit") -> None:
        """A host whose ``via`` (gpukit or nvidia-smi) prints ``answer`` exactly."""
        folder = self.root / host
        folder.mkdir(parents=True, exist_ok=True)
        data = answer.encode() if isinstance(answer, str) else answer
        (folder / "answer").write_bytes(data)
        self._bin(host, via, f"exec cat {shlex.quote(str(folder / 'answer'))}\n")

    def script(self, host: str, name: str, body: str) -> None:
        """A host whose ``name`` command runs the shell ``body``."""
        self._bin(host, name, body)

    def hanging(self, host: str) -> None:
        (self.root / host).mkdir(parents=True, exist_ok=True)
        (self.root / host / "hang").touch()

    def refusing(self, host: str) -> None:
        (self.root / host).mkdir(parents=True, exist_ok=True)
        (self.root / host / "refuse").touch()

    def live_processes(self) -> list[int]:
        """Pids of the processes still running that these hosts started (found by the
        FAKE_SSH_HOSTS their environment inherits), whenever they were killed."""
        marker = f"FAKE_SSH_HOSTS={self.root}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0") and alive(int(entry.name)):
                found.append(int(entry.name))
        return found


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped by its new parent) is not alive."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
