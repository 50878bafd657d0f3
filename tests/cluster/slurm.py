"""A real Slurm on this machine for the cluster tests: daemons, namespaces, teardown.

Debian's ``slurm-wlm`` and ``munge`` packages, started by hand from a temporary folder:

- one ``munged`` with its own key and socket (every Slurm command finds it through the
  ``AuthInfo=socket=`` line of the generated ``slurm.conf``);
- per cluster, one network + UTS + mount namespace per node (``unshare``, entered with
  ``nsenter``; ``ip netns exec`` would remount /sys, and slurmd 22.05 then refuses to start),
  each with its own host name and ``/etc/hosts``; two nodes are joined by a veth pair on
  private addresses that exist only inside those namespaces, a single node has loopback only;
- ``slurmctld`` in the first node's namespace (the login node: every command runs there), one
  ``slurmd`` per node, with ``proctrack/linuxproc``, ``task/none``, no cgroups, no accounting.

Every process started here is stopped by its pid; a process left in a namespace (a job step's
``slurmstepd``, a worker) is found by its network namespace and stopped too. Where the
packages are missing or a daemon cannot start, :class:`Unavailable` says why, and the tests
skip with that reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PROGRAMS = (
    "munged",
    "slurmctld",
    "slurmd",
    "srun",
    "sbatch",
    "scontrol",
    "unshare",
    "nsenter",
    "ip",
)
SUBNET = "10.77.0"  # private addresses, configured only inside the namespaces made here


class Unavailable(Exception):
    """A real Slurm cannot run here (no packages, not root, a daemon that will not start)."""


def _wait_for(what: str, check: object, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
    raise Unavailable(f"{what} did not come up within {timeout:.0f}s. {tail}")


def _stop(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """Stop one process this module started, by its pid: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=grace)


def _dies_with_us() -> None:
    """Between fork and exec: a session of its own, and SIGKILL when the test run dies.

    A test run killed outright (SIGKILL, a CI timeout) runs no teardown: the kernel's
    parent-death signal then stops the daemons and the namespaces' holders all the same.
    """
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _net_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _pids_in(ns: str) -> list[int]:
    """Every process whose network namespace is ``ns`` (a job's slurmstepd, its tasks)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _net_ns(int(entry)) == ns:
            found.append(int(entry))
    return found


@dataclass
class Node:
    """One node: a process holding its namespaces, and the daemons started in them."""

    name: str
    addr: str
    holder: subprocess.Popen[bytes]
    ns: str
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def enter(self) -> list[str]:
        """The command prefix that runs a program in this node's namespaces."""
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-u", "-m", "--"]

    def run(self, *cmd: str) -> None:
        subprocess.run([*self.enter(), *cmd], check=True, capture_output=True, timeout=30)

    def start(self, *cmd: str, log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [*self.enter(), *cmd],
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_dies_with_us,
            )
        self.daemons.append(proc)
        return proc

    def stop(self) -> None:
        """Stop the daemons, then whatever is left in the namespaces, then the holder."""
        for proc in reversed(self.daemons):
            _stop(proc)
        for _ in range(3):  # what the daemons started (slurmstepd, tasks) ends with them
            left = [p for p in _pids_in(self.ns) if p != self.holder.pid]
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        _stop(self.holder, grace=2.0)


class Munge:
    """A munged of its own: key, socket, pid and log in ``folder``."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(mode=0o700)
        self.folder = folder
        self.socket = folder / "munge.sock"
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        log = folder / "munged.log"
        command = [
            "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.socket}",
            f"--pid-file={folder / 'munged.pid'}", f"--log-file={log}",
            f"--seed-file={folder / 'munged.seed'}", "--num-threads=2",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            preexec_fn=_dies_with_us,
        )
        try:
            _wait_for("munged", lambda: self.socket.exists() or self.proc.poll() is not None, 15)
            if self.proc.poll() is not None:
                raise Unavailable(f"munged exited: {log.read_text(errors='replace')[-1000:]}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        _stop(self.proc)


CONF = """\
ClusterName={cluster}
SlurmctldHost={first}({first_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket}
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
PropagateResourceLimits=NONE
InactiveLimit=0
KillWait=3
MinJobAge=600
MessageTimeout=20
SlurmdTimeout=300
SlurmctldTimeout=300
JobRequeue=1
MailProg=/bin/true
PlugStackConfig={folder}/plugstack.conf
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """A running Slurm cluster of ``len(names)`` nodes; commands run on the first (login) node."""

    def __init__(self, folder: Path, munge: Munge, names: Sequence[str], cpus: int = 4) -> None:
        self.folder = folder
        self.names = list(names)
        self.nodes: list[Node] = []
        folder.mkdir(mode=0o700)
        (folder / "state").mkdir()
        (folder / "spool").mkdir()
        (folder / "plugstack.conf").write_text("")
        self.conf = folder / "slurm.conf"
        two = len(names) > 1
        addrs = [f"{SUBNET}.{i + 1}" if two else "127.0.0.1" for i in range(len(names))]
        lines = [
            f"NodeName={n} NodeAddr={a} CPUs={cpus} RealMemory=1000 State=UNKNOWN"
            for n, a in zip(names, addrs, strict=True)
        ]
        self.conf.write_text(
            CONF.format(
                cluster=f"gk{len(names)}",
                first=names[0],
                first_addr=addrs[0],
                socket=munge.socket,
                folder=folder,
                nodes="\n".join(lines),
            )
        )
        # No cgroup.conf: with proctrack/linuxproc and task/none, slurmd 22.05 loads no cgroup
        # plugin and reads none.
        hosts = folder / "hosts"
        hosts.write_text(
            "127.0.0.1 localhost\n"
            + "".join(
                f"{a} {n}\n" if two else f"127.0.0.1 {n}\n"
                for n, a in zip(names, addrs, strict=True)
            )
        )
        try:
            for name, addr in zip(names, addrs, strict=True):
                self.nodes.append(self._namespace(name, addr, hosts))
            if two:
                self._link()
            else:
                self._alone()
            login = self.nodes[0]
            ctl_log = folder / "slurmctld.log"
            ctl = login.start("slurmctld", "-D", "-i", "-f", str(self.conf), log=folder / "ctl.out")
            _wait_for(
                "slurmctld",
                lambda: ctl.poll() is not None or self._call("scontrol", "ping").returncode == 0,
                30,
                ctl_log,
            )
            if ctl.poll() is not None:
                raise Unavailable(f"slurmctld exited: {_tail(folder / 'ctl.out', ctl_log)}")
            for node in self.nodes:
                d = node.start(
                    "slurmd", "-D", "-f", str(self.conf), "-N", node.name,
                    log=folder / f"{node.name}.out",
                )  # fmt: skip
                time.sleep(0.2)
                if d.poll() is not None:
                    raise Unavailable(
                        f"slurmd {node.name} exited: "
                        f"{_tail(folder / f'{node.name}.out', folder / f'slurmd-{node.name}.log')}"
                    )
            _wait_for("the nodes", self._all_idle, 60, folder / "slurmctld.log")
        except BaseException:
            self.stop()
            raise

    def _namespace(self, name: str, addr: str, hosts: Path) -> Node:
        holder = subprocess.Popen(
            ["unshare", "--net", "--uts", "--mount", "--propagation", "private", "sleep", "1d"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_dies_with_us,
        )
        mine = _net_ns(os.getpid())
        _wait_for(
            f"the namespace of {name}",
            lambda: (
                holder.poll() is not None
                or ((ns := _net_ns(holder.pid)) is not None and ns != mine)
            ),
            10,
        )
        if holder.poll() is not None:
            err = holder.stderr.read().decode(errors="replace") if holder.stderr else ""
            raise Unavailable(f"unshare cannot make namespaces here: {err.strip()}")
        ns = _net_ns(holder.pid)
        assert ns is not None
        node = Node(name, addr, holder, ns)
        try:
            node.run("ip", "link", "set", "lo", "up")
            node.run("hostname", name)
            node.run("mount", "--bind", str(hosts), "/etc/hosts")
        except subprocess.CalledProcessError as exc:
            node.stop()
            raise Unavailable(f"cannot set up the namespace of {name}: {exc.stderr!r}") from exc
        return node

    def _link(self) -> None:
        first, second = self.nodes
        first.run(
            "ip", "link", "add", "gk0", "type", "veth", "peer", "name", "gk1",
            "netns", str(second.holder.pid),
        )  # fmt: skip
        for node, dev in ((first, "gk0"), (second, "gk1")):
            node.run("ip", "addr", "add", f"{node.addr}/24", "dev", dev)
            node.run("ip", "link", "set", dev, "up")

    def _alone(self) -> None:
        # getaddrinfo(AI_ADDRCONFIG), with which slurmctld looks up the address it listens on,
        # finds nothing where loopback is the only interface: give the node an address of its
        # own, on a veth pair whose both ends stay in its namespace.
        (node,) = self.nodes
        node.run("ip", "link", "add", "gk0", "type", "veth", "peer", "name", "gk0p")
        node.run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", "gk0")
        for dev in ("gk0", "gk0p"):
            node.run("ip", "link", "set", dev, "up")

    def _all_idle(self) -> bool:
        out = self._call("sinfo", "-h", "-N", "-o", "%N %T").stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(n, "").startswith("idle") for n in self.names)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a user of this cluster has: SLURM_CONF, no job of another's."""
        env = {k: v for k, v in (base or os.environ).items() if not k.startswith("SLURM")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def command(self, *cmd: str, node: int = 0) -> list[str]:
        """``cmd`` as run on ``node`` (the login node by default)."""
        return [*self.nodes[node].enter(), *cmd]

    def _call(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*cmd), env=self.env(), capture_output=True, text=True, timeout=30
        )

    def run(
        self, *cmd: str, env: dict[str, str] | None = None, timeout: float = 120, node: int = 0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` on a node of the cluster; a hang is killed (with what it started)."""
        proc = subprocess.Popen(
            self.command(*cmd, node=node),
            env=self.env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            self.cancel_all()
            err += f"\n[killed after {timeout}s]"
            return subprocess.CompletedProcess(proc.args, 124, out, err)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def job_state(self, job: str) -> str:
        """A job's state as ``scontrol show job`` says it (``COMPLETED``, ``PENDING``...)."""
        shown = self._call("scontrol", "show", "job", "-o", job).stdout
        return next((f.partition("=")[2] for f in shown.split() if f.startswith("JobState=")), "?")

    def batch(
        self, script: Path, *options: str, env: dict[str, str] | None = None, timeout: float = 180
    ) -> str:
        """Submit ``script`` with sbatch, wait for the job's end (polling, not sbatch --wait,
        which checks less and less often), and return its final state."""
        done = self.run("sbatch", "--parsable", *options, str(script), env=env)
        if done.returncode != 0:
            return f"not submitted: {done.stderr.strip()}"
        job = done.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED"):
                return state
            time.sleep(0.3)
        self.cancel_all()
        return f"still {self.job_state(job)} after {timeout:.0f}s"

    def cancel_all(self) -> None:
        """Cancel every job, so that a failed test leaves nothing running for the next."""
        self._call("scancel", "--full", "--user=root")

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()


def _tail(*logs: Path) -> str:
    return " | ".join(p.read_text(errors="replace")[-800:] for p in logs if p.exists())


def available() -> str | None:
    """Why a real Slurm cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the cluster tests need root (namespaces, munged, slurmd)"
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge openmpi-bin "
            "iproute2)"
        )
    return None


@contextlib.contextmanager
def munge(folder: Path) -> Iterator[Munge]:
    m = Munge(folder)
    try:
        yield m
    finally:
        m.stop()
