"""The GPUs of other machines, read over ssh with nothing to install there but what they have.

>>> from gpukit.gpus.hosts import read_hosts
>>> for r in read_hosts(["gpu1", "gpu2"], timeout=10):     # doctest: +SKIP
...     print(r.host, r.error or len(r.inventory.gpus))
gpu1 8
gpu2 unreachable: ssh: connect to host gpu2 port 22: Connection refused

Each host runs ``gpukit list --json`` when gpukit is installed there, else
``nvidia-smi --query-gpu=... --format=csv``, in one ssh round trip. All hosts are asked at once;
one that does not answer costs at most ``timeout`` seconds, after which its ssh (and everything
it started) is killed. What a host answers is data from another machine: it is parsed, never
run, and anything unreadable becomes that host's error.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gpukit.errors import GpukitError, InvalidArgumentError
from gpukit.gpus.claims import Holder
from gpukit.gpus.inventory import GPU, Inventory

SCHEMA = "gpukit.hosts/1"
SSH_VAR = "GPUKIT_SSH"

NVIDIA_SMI_FIELDS = (
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "memory.total",
    "memory.used",
    "memory.free",
    "utilization.gpu",
    "utilization.memory",
    "temperature.gpu",
    "power.draw",
    "power.limit",
    "driver_version",
)
"""The ``nvidia-smi --query-gpu`` fields read from a host without gpukit, in this order."""

REMOTE_SCRIPT = (
    "if command -v gpukit >/dev/null 2>&1; then exec gpukit list --json; "
    "elif python3 -c 'import gpukit' >/dev/null 2>&1; then exec python3 -m gpukit list --json; "
    f"else exec nvidia-smi --query-gpu={','.join(NVIDIA_SMI_FIELDS)} "
    "--format=csv,noheader,nounits; fi"
)
"""What runs on each host, through its login shell (ssh passes one command line)."""

_MAX_ANSWER = 16 * 2**20  # far beyond any inventory: such an answer is not parsed


@dataclass(frozen=True)
class HostReading:
    """What one host answered: its inventory, or why there is none."""

    host: str
    inventory: Inventory | None = None
    claims: Mapping[str, Holder] = field(default_factory=dict)
    """GPU UUID -> holder, as the host's gpukit reported them (empty through nvidia-smi)."""
    via: str | None = None
    """``'gpukit'`` or ``'nvidia-smi'``: what answered on the host."""
    error: str | None = None
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """``{host, via, elapsed_s, inventory, claims}`` or ``{host, elapsed_s, error}``."""
        out: dict[str, Any] = {"host": self.host, "elapsed_s": round(self.elapsed_s, 3)}
        if self.inventory is None:
            out["error"] = self.error
        else:
            out["via"] = self.via
            out["inventory"] = self.inventory.to_json()
            out["claims"] = {uuid: h.to_json() for uuid, h in self.claims.items()}
        return out


def hosts_json(readings: Sequence[HostReading]) -> dict[str, Any]:
    """The ``gpukit.hosts/1`` document: ``{schema, hosts: [{host, inventory | error}]}``."""
    return {"schema": SCHEMA, "hosts": [r.to_json() for r in readings]}


def ssh_command(timeout: float, configured: str | None = None) -> list[str]:
    """The command that reaches a host: ``configured``, else ``GPUKIT_SSH``, else batch-mode ssh.

    The host name and the remote command are appended to it.
    """
    text = configured if configured is not None else os.environ.get(SSH_VAR)
    if text is not None:
        try:
            words = shlex.split(text)
        except ValueError as exc:
            raise InvalidArgumentError(
                f"Cannot read the ssh command {text!r}: {exc}.",
                hint="Quote it as a shell would, e.g. --ssh-command 'ssh -p 2222'.",
            ) from exc
        if words:
            return words
    connect = max(1, math.ceil(timeout))
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect}"]


def parse_hosts(text: str) -> list[str]:
    """``'a,b, c'`` -> ``['a', 'b', 'c']``; refuses empty names and names ssh would misread."""
    hosts = [h.strip() for h in text.split(",")]
    bad = [h for h in hosts if not h or h.startswith("-") or any(c.isspace() for c in h)]
    if bad or not hosts:
        raise InvalidArgumentError(
            f"Cannot read the host list {text!r}: {', '.join(repr(b) for b in bad) or 'empty'} "
            "is not a host name.",
            hint="Give host names separated by commas, e.g. --hosts gpu1,gpu2,user@gpu3.",
        )
    return list(dict.fromkeys(hosts))


def _number(text: str) -> float | None:
    text = text.strip()
    if not text or text.startswith("[") or text.upper() in ("N/A", "NONE"):
        return None  # "[N/A]", "[Not Supported]": the GPU cannot give this reading
    return float(text)


def _whole(text: str) -> int | None:
    value = _number(text)
    return None if value is None else round(value)


def _mib(text: str) -> int | None:
    value = _number(text)
    return None if value is None else round(value * 2**20)


def parse_nvidia_smi_csv(text: str) -> Inventory:
    """Read ``nvidia-smi --query-gpu=<NVIDIA_SMI_FIELDS> --format=csv,noheader,nounits``.

    Memory comes in MiB and is given in bytes, as everywhere in gpukit. Raises
    InvalidArgumentError for text that is not such a table.
    """
    try:
        rows = list(csv.reader(io.StringIO(text), skipinitialspace=True))
    except csv.Error as exc:
        raise InvalidArgumentError(
            f"The answer is not CSV ({exc}).", hint="Check that nvidia-smi works on that host."
        ) from exc
    gpus = []
    driver = None
    for row in rows:
        if not row:
            continue
        if len(row) != len(NVIDIA_SMI_FIELDS):
            raise InvalidArgumentError(
                f"Expected {len(NVIDIA_SMI_FIELDS)} nvidia-smi columns, got {len(row)}: "
                f"{','.join(row)[:120]!r}.",
                hint="Check that nvidia-smi works on that host.",
            )
        v = dict(zip(NVIDIA_SMI_FIELDS, (c.strip() for c in row), strict=True))
        try:
            index = int(v["index"])
            power = _number(v["power.draw"])
            limit = _number(v["power.limit"])
            gpus.append(
                GPU(
                    index=index,
                    uuid=v["uuid"],
                    name=v["name"],
                    pci_bus_id=v["pci.bus_id"] or None,
                    memory_total=_mib(v["memory.total"]),
                    memory_used=_mib(v["memory.used"]),
                    memory_free=_mib(v["memory.free"]),
                    utilization_gpu=_whole(v["utilization.gpu"]),
                    utilization_memory=_whole(v["utilization.memory"]),
                    temperature_c=_whole(v["temperature.gpu"]),
                    power_draw_w=power,
                    power_limit_w=limit,
                )
            )
        except ValueError as exc:
            raise InvalidArgumentError(
                f"Cannot read the nvidia-smi line {','.join(row)[:120]!r} ({exc}).",
                hint="Check that nvidia-smi works on that host.",
            ) from exc
        driver = driver or v["driver_version"] or None
    if not gpus:
        raise InvalidArgumentError(
            "nvidia-smi listed no GPU.", hint="Check that nvidia-smi works on that host."
        )
    return Inventory(gpus=tuple(gpus), driver_version=driver, source="nvidia-smi")


def _claims(payload: Mapping[str, Any]) -> dict[str, Holder]:
    raw = payload.get("claims")
    if not isinstance(raw, Mapping):
        return {}
    claims = {}
    for uuid, record in raw.items():
        if isinstance(record, Mapping):
            # Another machine's record: keep each field only when it has the right type.
            def get(key: str, kind: type | tuple[type, ...], r: Mapping[str, Any] = record) -> Any:
                value = r.get(key)
                return value if isinstance(value, kind) and not isinstance(value, bool) else None

            claims[str(uuid)] = Holder(
                user=get("user", str),
                pid=get("pid", int),
                host=get("host", str),
                command=get("command", str),
                since=get("since", (int, float)),
            )
    return claims


_INT = (int,)
_NUMBER = (int, float)
_TEXT = (str,)
# What each reading of another machine's inventory must be (or None), before anything shows it.
_GPU_FIELDS = {
    "index": _INT,
    "uuid": _TEXT,
    "name": _TEXT,
    "pci_bus_id": _TEXT,
    "memory_total": _INT,
    "memory_used": _INT,
    "memory_free": _INT,
    "memory_reserved": _INT,
    "utilization_gpu": _NUMBER,
    "utilization_memory": _NUMBER,
    "temperature_c": _NUMBER,
    "power_draw_w": _NUMBER,
    "power_limit_w": _NUMBER,
    "error": _TEXT,
}
_MIG_FIELDS = {
    "index": _INT,
    "uuid": _TEXT,
    "name": _TEXT,
    "memory_total": _INT,
    "memory_used": _INT,
}
_PROCESS_FIELDS = {"pid": _INT, "user": _TEXT, "command": _TEXT, "used_memory": _INT}
_REQUIRED = {"index", "uuid", "name", "pid"}


def _check(item: object, fields: Mapping[str, tuple[type, ...]], what: str) -> None:
    for name, kinds in fields.items():
        value = getattr(item, name)
        if value is None and name not in _REQUIRED:
            continue
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise InvalidArgumentError(f"its gpukit gave a {what} {name} of {value!r}.")


def _check_inventory(inv: Inventory) -> Inventory:
    """``inv``, once every reading the table shows has its type: another machine wrote it."""
    for gpu in inv.gpus:
        _check(gpu, _GPU_FIELDS, "GPU")
        for mig in gpu.mig_instances:
            _check(mig, _MIG_FIELDS, "MIG instance")
            for p in mig.processes:
                _check(p, _PROCESS_FIELDS, "process")
        for p in gpu.processes:
            _check(p, _PROCESS_FIELDS, "process")
    for name in ("driver_version", "cuda_driver_version"):
        value = getattr(inv, name)
        if value is not None and not isinstance(value, str):
            raise InvalidArgumentError(f"its gpukit gave a {name} of {value!r}.")
    return inv


def parse_answer(host: str, stdout: str) -> HostReading:
    """Turn a host's standard output (gpukit JSON or nvidia-smi CSV) into a reading."""
    text = stdout.strip()
    try:
        if text.startswith("{"):
            try:
                payload = json.loads(text)
            except ValueError as exc:
                raise InvalidArgumentError(f"its gpukit answered broken JSON ({exc}).") from exc
            if not isinstance(payload, dict):
                raise InvalidArgumentError("its gpukit answered JSON that is not an inventory.")
            try:
                inv = _check_inventory(Inventory.from_json(payload))
            except (ArithmeticError, AttributeError, LookupError, TypeError, ValueError) as exc:
                # from_json trusts its writer's shapes; another machine's answer earns no trust.
                raise InvalidArgumentError(
                    f"its gpukit answered a malformed inventory ({exc!r})."
                ) from exc
            return HostReading(host, inv, claims=_claims(payload), via="gpukit")
        return HostReading(host, parse_nvidia_smi_csv(text), via="nvidia-smi")
    except GpukitError as exc:
        first = text.splitlines()[0][:120] if text else "nothing"
        return HostReading(host, error=f"unreadable answer ({exc.message}; it began {first!r})")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` and everything it started (its own session), and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def read_host(host: str, ssh: Sequence[str], timeout: float) -> HostReading:
    """Ask one host for its GPUs through ``ssh``; never raises for a host that fails."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [*ssh, host, REMOTE_SCRIPT],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # so that a timeout kills ssh's children too
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return HostReading(
            host,
            error=f"unreachable: no answer within {timeout:g} s",
            elapsed_s=time.monotonic() - start,
        )
    except BaseException:
        _stop(proc)
        raise
    elapsed = time.monotonic() - start
    if len(out) > _MAX_ANSWER:
        return HostReading(host, error="answered more than 16 MiB; not read", elapsed_s=elapsed)
    stderr = err.decode(errors="replace")
    if proc.returncode != 0:
        why = _last_line(stderr) or f"{ssh[0]} exited with status {proc.returncode}"
        prefix = "unreachable" if proc.returncode == 255 else "failed"
        return HostReading(host, error=f"{prefix}: {why}", elapsed_s=elapsed)
    reading = parse_answer(host, out.decode(errors="replace"))
    return HostReading(
        reading.host, reading.inventory, reading.claims, reading.via, reading.error, elapsed
    )


def read_hosts(
    hosts: Sequence[str], *, timeout: float = 10.0, ssh_command_text: str | None = None
) -> list[HostReading]:
    """Read every host's GPUs at once; a host that fails gets an error, in the same order.

    ``ssh_command_text`` overrides ``GPUKIT_SSH`` and the default batch-mode ssh.
    """
    if not (timeout > 0 and math.isfinite(timeout)):
        raise InvalidArgumentError(
            f"Cannot wait {timeout} s for hosts.",
            hint="Give --timeout a positive number of seconds, e.g. 10.",
        )
    if not hosts:
        raise InvalidArgumentError("No host to read.", hint="Give --hosts gpu1,gpu2.")
    ssh = ssh_command(timeout, ssh_command_text)
    if shutil.which(ssh[0]) is None:
        raise InvalidArgumentError(
            f"Cannot reach hosts: the ssh command {ssh[0]!r} is not found.",
            hint=f"Install an ssh client, or set --ssh-command or {SSH_VAR}.",
        )
    with ThreadPoolExecutor(max_workers=min(len(hosts), 64)) as pool:
        return list(pool.map(lambda h: read_host(h, ssh, timeout), hosts))
