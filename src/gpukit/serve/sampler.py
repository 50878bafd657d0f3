"""Sampling the machine in the background: the last reading, and an hour of history per GPU.

A :class:`Sampler` reads the inventory and how the GPUs are shared (``gpukit queue``'s
snapshot: holders, waiters) every ``interval`` seconds on its own thread, and renders
everything the server hands out (the Prometheus text, the JSON documents) right there. A request
only picks up the bytes of the last sample, so a slow client never delays sampling and a scrape
costs the same however busy the machine is.

A sample has parts: ``"gpus"`` (NVML's reading), ``"tensor"`` (each GPU's tensor activity since
the previous sample, from GPM: :mod:`gpukit.gpus.gpm`) and ``"claims"`` (holders and the line,
read from the lock folder, which other users write). Whatever one part raises, the others are still
read and served, and the sample is marked stale with the part and why in
:attr:`Sample.failed`: the GPUs of the last good reading are kept and said to be old, claims
that could not be read are unknown (never "free"). A server never stops on someone else's file.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpukit.errors import GpukitError, InvalidArgumentError
from gpukit.gpus.gpm import TensorActivity
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.output import dumps
from gpukit.sharing.report import Sharing, sharing
from gpukit.untrusted import printable

HISTORY_S = 3600.0
"""How far back the in-memory history reaches (the dashboard's charts show the last hour)."""
CHART_POINTS = 120
"""At most this many points per GPU are sent to the page: bucket means over the hour."""
STATE_SCHEMA = "gpukit.serve.state/1"


@dataclass(frozen=True)
class Sample:
    """One reading of the machine, with everything a request needs already rendered.

    Args:
        taken_at: when it was taken, in Unix seconds.
        inventory: the GPUs; the previous sample's when they could not be read; None: none yet.
        queue: holders and waiters; None when they could not be read.
        error: why the GPUs could not be read; None: they were.
        failed: the parts that failed (``"gpus"``, ``"claims"``...) -> why; empty: none did.
        metrics: the Prometheus exposition served at ``/metrics``.
        inventory_json: the JSON served at ``/api/inventory``.
        queue_json: the JSON served at ``/api/queue``.
        state_json: the JSON served at ``/api/state``.
    """

    taken_at: float
    inventory: Inventory | None
    queue: Sharing | None
    """Holders and waiters; ``None`` when they could not be read (the lock folder refused as
    unsafe, no GPUs read)."""
    error: str | None
    """Why the GPUs could not be read (the previous inventory is kept, marked stale)."""
    failed: dict[str, str] = field(default_factory=dict)
    """The parts of this sample that failed (``"gpus"``, ``"tensor"``, ``"claims"``,
    ``"history"``, ``"render"``), each with why; empty when every part was read."""
    metrics: bytes = b""
    inventory_json: bytes = b""
    queue_json: bytes = b""
    state_json: bytes = b""

    @property
    def stale(self) -> bool:
        """True when any part of this sample failed: what it shows is old or unknown."""
        return bool(self.failed)


@dataclass
class _Series:
    times: deque[float] = field(default_factory=deque)
    util: deque[float | None] = field(default_factory=deque)
    memory: deque[float | None] = field(default_factory=deque)


def _ratio(part: float | None, whole: float | None) -> float | None:
    return None if part is None or not whole else part / whole


def _bucket_means(
    times: list[float], values: list[float | None], start: float, end: float, points: int
) -> list[float | None]:
    sums = [0.0] * points
    counts = [0] * points
    width = (end - start) / points
    for t, v in zip(times, values, strict=True):
        if v is None or t < start:
            continue
        slot = min(int((t - start) / width), points - 1)
        sums[slot] += v
        counts[slot] += 1
    return [s / c if c else None for s, c in zip(sums, counts, strict=True)]


class History:
    """Utilisation and memory of each GPU over the last hour, kept in memory.

    Args:
        span_s: how many seconds of readings to keep (default: an hour).
    """

    def __init__(self, span_s: float = HISTORY_S) -> None:
        self.span_s = span_s
        self._series: dict[str, _Series] = {}

    def add(self, inv: Inventory) -> None:
        """Record one reading and forget what is older than the span.

        Args:
            inv: one reading of the machine.
        """
        now = inv.taken_at
        for gpu in inv.gpus:
            if not gpu.uuid:
                continue
            series = self._series.setdefault(gpu.uuid, _Series())
            util = None if gpu.utilization_gpu is None else gpu.utilization_gpu / 100
            series.times.append(now)
            series.util.append(util)
            series.memory.append(_ratio(gpu.memory_used, gpu.memory_total))
        for series in self._series.values():
            while series.times and series.times[0] < now - self.span_s:
                series.times.popleft()
                series.util.popleft()
                series.memory.popleft()

    def chart(self, now: float, points: int = CHART_POINTS) -> dict[str, Any]:
        """``{uuid: {"util": [...], "memory": [...]}}``: ``points`` bucket means (0..1 or null)
        over the span ending at ``now``, oldest first.

        Args:
            now: the end of the span, in ``time.time()`` seconds.
            points: how many buckets to split the span into.
        """
        start = now - self.span_s
        out: dict[str, Any] = {}
        for uuid, s in self._series.items():
            times = list(s.times)
            out[uuid] = {
                "util": _bucket_means(times, list(s.util), start, now, points),
                "memory": _bucket_means(times, list(s.memory), start, now, points),
            }
        return {"span_s": self.span_s, "points": points, "gpus": out}


def _dumps(payload: Any) -> bytes:
    # No NaN or Infinity: the page's JSON.parse would refuse the whole document.
    return dumps(payload, default=str, separators=(",", ":")).encode()


def _why(exc: BaseException) -> str:
    """One printable line for a failure, whoever wrote the text in it."""
    text = exc.message if isinstance(exc, GpukitError) else f"{type(exc).__name__}: {exc}"
    return printable(text, limit=300) or type(exc).__name__


class Sampler:
    """Reads the machine every ``interval`` seconds on a background thread.

    >>> sampler = Sampler(interval=2.0)
    >>> sampler.start()           # the first reading, now; raises NoDriverError without a driver
    >>> sampler.latest.metrics.startswith(b"# HELP")
    True
    >>> sampler.stop()

    Args:
        interval: seconds between readings, above 0.
        read: reads the machine; the default is :func:`gpukit.inventory`.
        host: the name this machine's readings are labelled with; None: its hostname.
        tensor_activity: keeps each GPU's last GPM sample between readings, and gives the
            tensor activity since; None: a new :class:`~gpukit.gpus.gpm.TensorActivity` on
            the NVML :func:`gpukit.inventory` reads. :meth:`stop` frees its samples.
    """

    def __init__(
        self,
        interval: float = 2.0,
        *,
        read: Callable[[], Inventory] = inventory,
        host: str | None = None,
        tensor_activity: TensorActivity | None = None,
    ) -> None:
        if not interval > 0 or interval == float("inf"):
            raise InvalidArgumentError(
                f"Cannot sample every {interval} s.",
                hint="Give --interval a positive number of seconds, e.g. 2.",
            )
        self.interval = float(interval)
        self.host = socket.gethostname() if host is None else host
        """The machine's name as the page shows it."""
        self._read = read
        self._tensor = TensorActivity() if tensor_activity is None else tensor_activity
        self.history = History()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._latest: Sample | None = None
        self._failure: GpukitError | None = None

    @property
    def latest(self) -> Sample:
        """The last sample (taken by :meth:`start` at the latest)."""
        if self._latest is None:
            self.sample()
        assert self._latest is not None
        return self._latest

    def sample(self) -> Sample:
        """Read the machine once, render every document, and make it the latest sample.

        Never raises for a part that fails (see the module's notes): that part is named in
        :attr:`Sample.failed`, and the sample is stale.
        """
        previous = self._latest
        failed: dict[str, str] = {}
        inv = self._read_gpus(previous, failed)
        # The GPUs of an old reading get no tensor activity: GPM measures between two new ones.
        tensor = self._read_tensor(inv, failed) if inv is not None and "gpus" not in failed else {}
        queue = self._read_claims(inv, failed) if inv is not None else None
        try:
            sample = self._render(inv, queue, failed, tensor)
        except Exception as exc:  # a reading no renderer expected: still serve something
            failed["render"] = f"Rendering failed: {_why(exc)}"
            sample = self._render(None, None, failed, {})
        self._latest = sample  # one reference swap: readers see the old sample or the new one
        return sample

    def _read_gpus(self, previous: Sample | None, failed: dict[str, str]) -> Inventory | None:
        try:
            inv = self._read()
        except Exception as exc:
            failed["gpus"] = _why(exc)
            if isinstance(exc, GpukitError):
                self._failure = exc
            return previous.inventory if previous else None
        try:
            self.history.add(inv)
        except Exception as exc:  # a reading the history cannot hold: the rest still serves
            failed["history"] = f"History not updated: {_why(exc)}"
        return inv

    def _read_tensor(self, inv: Inventory, failed: dict[str, str]) -> Mapping[str, float]:
        try:
            return self._tensor.read(inv)
        except Exception as exc:  # a driver failing GPM: the GPUs' other readings still serve
            failed["tensor"] = f"Tensor activity unknown: {_why(exc)}"
            return {}

    @staticmethod
    def _read_claims(inv: Inventory, failed: dict[str, str]) -> Sharing | None:
        try:
            # Read-only: the server shows the line and the holders; it keeps no idle ledger.
            return sharing(inv, observe=False)
        except Exception as exc:  # a refused lock folder, a co-user's hostile file, a bug
            failed["claims"] = f"Claims unknown: {_why(exc)}"
            return None

    def _render(
        self,
        inv: Inventory | None,
        queue: Sharing | None,
        failed: dict[str, str],
        tensor: Mapping[str, float],
    ) -> Sample:
        from gpukit.serve.metrics import exposition

        now = time.time()
        error = failed.get("gpus")
        inv_doc = None if inv is None else inv.to_json()
        queue_doc = queue.to_json() if queue is not None else {"error": failed.get("claims")}
        state = {
            "schema": STATE_SCHEMA,
            "host": self.host,
            "taken_at": now,
            "interval_s": self.interval,
            "error": "; ".join(failed.values()) or None,
            "stale": bool(failed),
            "failed": failed,
            "inventory": inv_doc,
            "queue": queue_doc,
            "history": self.history.chart(now),
        }
        return Sample(
            taken_at=now,
            inventory=inv,
            queue=queue,
            error=error,
            failed=dict(failed),
            metrics=exposition(
                inv,
                queue,
                ok="gpus" not in failed,
                stale=bool(failed),
                host=self.host,
                tensor_active=tensor,
            ),
            inventory_json=_dumps(inv_doc if inv_doc is not None else {"error": error}),
            queue_json=_dumps(queue_doc),
            state_json=_dumps(state),
        )

    def start(self) -> None:
        """Take the first sample here (so that errors such as NoDriverError surface), then keep
        sampling on a daemon thread until :meth:`stop`."""
        self._failure = None
        if self.sample().inventory is None and self._failure is not None:
            raise self._failure  # nothing to serve at all: no driver, no NVML
        # Any other failed part (a co-user's hostile ticket, a refused lock folder) is served
        # as such: the page and /metrics say what failed.
        self._thread = threading.Thread(target=self._loop, name="gpukit-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception as exc:  # a bug must not stop the sampling of a long-running server
                print(f"gpukit serve: sampling failed: {exc!r}", file=sys.stderr)

    def stop(self) -> None:
        """Stop sampling, wait for the thread to end, and free the GPM samples kept."""
        self._stop.set()
        if self._thread is not None:
            with contextlib.suppress(RuntimeError):
                self._thread.join(timeout=10)
            self._thread = None
        self._tensor.close()
