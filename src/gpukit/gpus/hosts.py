"""The GPUs of other machines, read over ssh with nothing to install there but what they have.

>>> from gpukit.gpus.hosts import read_hosts
>>> for r in read_hosts(["gpu1", "gpu2"], timeout=10):     # doctest: +SKIP
...     print(r.host, r.error or len(r.inventory.gpus))
gpu1 8
gpu2 unreachable: ssh: connect to host gpu2 port 22: Connection refused

Each host runs ``gpukit list --json`` when gpukit is installed there, else
``nvidia-smi --query-gpu=... --format=csv``, in one ssh round trip. All hosts are asked at once;
one that does not answer costs at most ``timeout`` seconds, after which its ssh (and everything
it started) is killed. What a host answers is data from another machine: it is read with a cap
(:data:`ANSWER_LIMIT`, its ssh killed past it), parsed through :mod:`gpukit.untrusted` with every
field checked by type and range and every string made printable, never run; anything refused
becomes that host's error, and the other hosts are shown as if it had not answered at all.
"""

from __future__ import annotations

import contextlib
import csv
import io
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
from gpukit.gpus.inventory import GPU, GpuProcess, Inventory, MigInstance
from gpukit.gpus.inventory import SCHEMA as INVENTORY_SCHEMA
from gpukit.holders import Holder
from gpukit.sizes import format_size
from gpukit.untrusted import (
    InvalidInput,
    as_dict,
    as_float,
    as_int,
    as_list,
    as_str,
    parse_json,
    printable,
    read_streams,
)

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
    "enforced.power.limit",
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


MAX_GPUS = 64
"""The most GPUs gpukit reads from one host's answer. The largest single machines have 16; an
answer listing more is not one machine's inventory, and is refused rather than shown, so that
one host cannot make the table of all hosts arbitrarily long."""

ANSWER_LIMIT = 4 * 2**20
"""The most bytes of standard output read from one host (64 busy GPUs take well under 1 MiB).
At the limit the host's ssh is killed: an endless answer costs this much memory, no more."""

MESSAGES_LIMIT = 64 * 2**10
"""The most bytes of standard error (ssh's and the host's messages) read from one host."""

_MAX_BYTES = 2**60  # memory readings past an exbibyte are not readings
_MEMORY = {"low": -_MAX_BYTES, "high": _MAX_BYTES}  # free memory can read below 0
_MAX_WATTS = 1e6


def _text(value: object, *, what: str, limit: int = 500, required: bool = False) -> str | None:
    """A string of the answer, with every control character as ``?``; None if absent."""
    if value is None and not required:
        return None
    shown = printable(as_str(value, limit=4 * limit, what=what), limit=limit)
    if shown is None and required:
        raise InvalidInput(f"{what} is empty")
    return shown


def _maybe(value: object, check: Any, **bounds: Any) -> Any:
    return None if value is None else check(value, **bounds)


def _number(text: str, *, what: str, high: float) -> float | None:
    """One nvidia-smi reading: a finite number from 0 to ``high``, or None for "[N/A]"."""
    text = text.strip()
    if not text or text.startswith("[") or text.upper() in ("N/A", "NONE"):
        return None  # "[N/A]", "[Not Supported]": the GPU cannot give this reading
    if len(text) > 32:
        raise InvalidInput(f"{what} is not a number")
    try:
        value = float(text)
    except ValueError:
        raise InvalidInput(f"{what} is not a number") from None
    return as_float(value, low=0, high=high, what=what)


def _whole(text: str, *, what: str, high: float) -> int | None:
    value = _number(text, what=what, high=high)
    return None if value is None else round(value)


def _mib(text: str, *, what: str) -> int | None:
    value = _number(text, what=what, high=_MAX_BYTES / 2**20)  # nvidia-smi never reads < 0
    return None if value is None else round(value * 2**20)


def parse_nvidia_smi_csv(text: str) -> Inventory:
    """Read ``nvidia-smi --query-gpu=<NVIDIA_SMI_FIELDS> --format=csv,noheader,nounits``.

    Memory comes in MiB and is given in bytes, as everywhere in gpukit. Every number must be
    finite and in range, every string is made printable, and at most :data:`MAX_GPUS` rows are
    read. Raises InvalidArgumentError for text that is not such a table.
    """
    hint = "Check that nvidia-smi works on that host."
    try:
        rows = [row for row in csv.reader(io.StringIO(text), skipinitialspace=True) if row]
    except csv.Error:
        raise InvalidArgumentError("the answer is not CSV.", hint=hint) from None
    if len(rows) > MAX_GPUS:
        raise InvalidArgumentError(
            f"nvidia-smi listed {len(rows)} GPUs, more than the {MAX_GPUS} gpukit reads from "
            "one host.",
            hint=hint,
        )
    gpus = []
    driver = None
    for row in rows:
        if len(row) != len(NVIDIA_SMI_FIELDS):
            raise InvalidArgumentError(
                f"expected {len(NVIDIA_SMI_FIELDS)} nvidia-smi columns, got {len(row)}.",
                hint=hint,
            )
        v = dict(zip(NVIDIA_SMI_FIELDS, (c.strip() for c in row), strict=True))
        try:
            index = _whole(v["index"], what="index", high=2**31)
            if index is None:
                raise InvalidInput("index is missing")
            gpus.append(
                GPU(
                    index=index,
                    uuid=_text(v["uuid"], what="uuid", limit=128, required=True) or "",
                    name=_text(v["name"], what="name", limit=128, required=True) or "",
                    pci_bus_id=_text(v["pci.bus_id"], what="pci.bus_id", limit=64),
                    memory_total=_mib(v["memory.total"], what="memory.total"),
                    memory_used=_mib(v["memory.used"], what="memory.used"),
                    memory_free=_mib(v["memory.free"], what="memory.free"),
                    utilization_gpu=_whole(v["utilization.gpu"], what="utilization", high=100),
                    utilization_memory=_whole(
                        v["utilization.memory"], what="utilization", high=100
                    ),
                    temperature_c=_whole(v["temperature.gpu"], what="temperature", high=1000),
                    power_draw_w=_number(v["power.draw"], what="power.draw", high=_MAX_WATTS),
                    power_limit_w=_number(
                        v["enforced.power.limit"], what="enforced.power.limit", high=_MAX_WATTS
                    ),
                )
            )
        except InvalidInput as exc:
            raise InvalidArgumentError(
                f"nvidia-smi line {len(gpus) + 1}: {exc}.", hint=hint
            ) from None
        driver = driver or _text(v["driver_version"], what="driver_version", limit=64)
    if not gpus:
        raise InvalidArgumentError("nvidia-smi listed no GPU.", hint=hint)
    return Inventory(gpus=tuple(gpus), driver_version=driver, source="nvidia-smi")


def _process(item: object) -> GpuProcess:
    p = as_dict(item, what="a process")
    return GpuProcess(
        pid=as_int(p.get("pid"), high=2**32, what="a process's pid"),
        user=_text(p.get("user"), what="a process's user", limit=64),
        command=_text(p.get("command"), what="a process's command"),
        used_memory=_maybe(p.get("used_memory"), as_int, what="used_memory", **_MEMORY),
    )


def _processes(value: object) -> tuple[GpuProcess, ...]:
    return tuple(_process(p) for p in as_list([] if value is None else value, what="processes"))


def _mig(item: object) -> MigInstance:
    m = as_dict(item, what="a MIG instance")
    memory = {
        key: _maybe(m.get(key), as_int, what=key, **_MEMORY)
        for key in ("memory_total", "memory_used")
    }
    return MigInstance(
        index=as_int(m.get("index"), high=64, what="a MIG instance's index"),
        uuid=_text(m.get("uuid"), what="a MIG instance's uuid", limit=128, required=True) or "",
        name=_text(m.get("name"), what="a MIG instance's name", limit=128),
        processes=_processes(m.get("processes")),
        **memory,
    )


def _gpu(item: object) -> GPU:
    g = as_dict(item, what="a GPU")
    memory = {
        key: _maybe(g.get(key), as_int, what=key, **_MEMORY)
        for key in ("memory_total", "memory_used", "memory_free", "memory_reserved")
    }
    cc = g.get("compute_capability")
    if cc is not None:
        pair = as_list(cc, limit=2, what="compute_capability")
        if len(pair) != 2:
            raise InvalidInput("compute_capability is not a pair")
        cc = tuple(as_int(n, high=100, what="compute_capability") for n in pair)
    mig_mode = g.get("mig_mode")
    if mig_mode is not None and type(mig_mode) is not bool:
        raise InvalidInput("mig_mode is not true or false")
    return GPU(
        index=as_int(g.get("index"), high=2**31, what="a GPU's index"),
        uuid=_text(g.get("uuid"), what="a GPU's uuid", limit=128, required=True) or "",
        name=_text(g.get("name"), what="a GPU's name", limit=128, required=True) or "",
        pci_bus_id=_text(g.get("pci_bus_id"), what="pci_bus_id", limit=64),
        utilization_gpu=_maybe(g.get("utilization_gpu"), as_int, high=100, what="utilization"),
        utilization_memory=_maybe(
            g.get("utilization_memory"), as_int, high=100, what="utilization"
        ),
        temperature_c=_maybe(
            g.get("temperature_c"), as_int, low=-273, high=1000, what="temperature"
        ),
        power_draw_w=_maybe(g.get("power_draw_w"), as_float, low=0, high=_MAX_WATTS),
        power_limit_w=_maybe(g.get("power_limit_w"), as_float, low=0, high=_MAX_WATTS),
        compute_capability=cc,
        mig_mode=mig_mode,
        mig_instances=tuple(_mig(m) for m in as_list(g.get("mig_instances", []), limit=16)),
        processes=_processes(g.get("processes")),
        error=_text(g.get("error"), what="a GPU's error"),
        **memory,
    )


def _inventory(payload: dict[str, Any]) -> Inventory:
    """The inventory in a host's ``gpukit list --json``, every field checked by type and range,
    every string made printable: the table and the JSON show only what passed."""
    schema = payload.get("schema")
    if schema != INVENTORY_SCHEMA:
        shown = printable(schema, limit=40) if type(schema) is str else None
        raise InvalidInput(
            f"its gpukit wrote {shown or 'no'} schema; this gpukit reads {INVENTORY_SCHEMA!r}"
        )
    gpus = as_list(payload.get("gpus"), limit=4096, what="gpus")
    if len(gpus) > MAX_GPUS:
        raise InvalidInput(f"it lists {len(gpus)} GPUs, more than the {MAX_GPUS} gpukit reads")
    return Inventory(
        gpus=tuple(_gpu(g) for g in gpus),
        driver_version=_text(payload.get("driver_version"), what="driver_version", limit=64),
        cuda_driver_version=_text(payload.get("cuda_driver_version"), what="the CUDA version"),
        taken_at=_maybe(payload.get("taken_at"), as_float, low=0, high=1e11) or 0.0,
        elapsed_s=_maybe(payload.get("elapsed_s"), as_float, low=0, high=1e6) or 0.0,
        source=_text(payload.get("source"), what="source", limit=200) or "nvml",
    )


def _claims(payload: dict[str, Any]) -> dict[str, Holder]:
    """GPU UUID -> holder, as the host's gpukit wrote them; a record of the wrong shape is
    dropped (claims are extra information), every string made printable."""
    raw = payload.get("claims")
    if type(raw) is not dict or len(raw) > 4 * MAX_GPUS:
        return {}
    claims = {}
    for uuid, record in raw.items():
        try:
            r = as_dict(record)
            key = _text(uuid, what="a claimed GPU", limit=128, required=True) or ""
            claims[key] = Holder(
                user=_text(r.get("user"), what="user", limit=64),
                pid=_maybe(r.get("pid"), as_int, high=2**32),
                host=_text(r.get("host"), what="host", limit=255),
                command=_text(r.get("command"), what="command"),
                since=_maybe(r.get("since"), as_float, low=0, high=1e11),
                problem=_text(r.get("problem"), what="problem"),
            )
        except InvalidInput:
            continue
    return claims


def parse_answer(host: str, stdout: str | bytes) -> HostReading:
    """Turn a host's standard output (gpukit JSON or nvidia-smi CSV) into a reading.

    Anything not understood becomes the host's error (``answer not understood: ...``), never an
    exception: one host's answer cannot stop the others from being shown.
    """
    data = stdout.encode(errors="replace") if isinstance(stdout, str) else stdout
    text = data.decode(errors="replace").strip()
    try:
        if text.startswith("{"):
            try:
                payload = as_dict(parse_json(data, limit=ANSWER_LIMIT), what="the answer")
                return HostReading(host, _inventory(payload), _claims(payload), via="gpukit")
            except InvalidInput as exc:
                # Said without the answer itself: JSON's first line is "{".
                return HostReading(host, error=f"answer not understood: its gpukit answered {exc}")
        return HostReading(host, parse_nvidia_smi_csv(text), via="nvidia-smi")
    except GpukitError as exc:
        first = printable(text.splitlines()[0] if text else "", limit=80)
        began = f"; it began {first!r}" if first else ""
        return HostReading(host, error=f"answer not understood: {exc.message.rstrip('.')}{began}")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (printable(lines[-1], limit=300) or "") if lines else ""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` and everything it started (its own session), and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def read_host(host: str, ssh: Sequence[str], timeout: float) -> HostReading:
    """Ask one host for its GPUs through ``ssh``; never raises for a host that fails.

    Its output is read as it comes, at most :data:`ANSWER_LIMIT` bytes of answer and
    :data:`MESSAGES_LIMIT` of messages: past either, or past ``timeout``, its ssh (and
    everything that ssh started) is killed.
    """
    start = time.monotonic()
    proc = subprocess.Popen(
        [*ssh, host, REMOTE_SCRIPT],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # so that a timeout kills ssh's children too
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    limits = (ANSWER_LIMIT, MESSAGES_LIMIT)
    try:
        streams = read_streams(
            [proc.stdout.fileno(), proc.stderr.fileno()], limits, timeout=timeout
        )
        if streams.complete:
            # Both pipes ended: ssh is exiting. Give it what is left of the time to say how.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(timeout - (time.monotonic() - start), 0.01))
    finally:
        if proc.returncode is None:
            _stop(proc)
        else:
            proc.communicate()
    elapsed = time.monotonic() - start
    out, err = streams.data
    if streams.over_limit is not None:
        what = ("answer", "messages")[streams.over_limit]
        limit = format_size(limits[streams.over_limit])
        return HostReading(host, error=f"{what} larger than {limit}; not read", elapsed_s=elapsed)
    if streams.timed_out or proc.returncode < 0:
        return HostReading(
            host, error=f"unreachable: no answer within {timeout:g} s", elapsed_s=elapsed
        )
    if proc.returncode != 0:
        why = _last_line(err.decode(errors="replace"))
        why = why or f"{ssh[0]} exited with status {proc.returncode}"
        prefix = "unreachable" if proc.returncode == 255 else "failed"
        return HostReading(host, error=f"{prefix}: {why}", elapsed_s=elapsed)
    reading = parse_answer(host, out)
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
