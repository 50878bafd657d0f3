"""NVIDIA's DCGM dashboard against gpukit serve, through a real Prometheus scraping it.

``gpukit serve`` runs on the fake 8-GPU server and Debian's ``prometheus`` scrapes it every
second; each panel's query of the "NVIDIA DCGM Exporter Dashboard" (grafana.com 12239, a copy
in ``tests/fixtures/dcgm/``) is then sent as Grafana sends it, its variables set to "All" from
the dashboard's own variable queries. The "Tensor Core Utilization" panel needs GPUs with GPM
(Hopper and newer, which the 8 A100s are not): it is also run against the fake H100 server.
Skips where the ``prometheus`` program is not installed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import MACHINES, ROOT, subprocess_env

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="no prometheus program (apt-get install --no-install-recommends prometheus)",
    ),
]

DASHBOARD = json.loads(
    (ROOT / "tests" / "fixtures" / "dcgm" / "dcgm-exporter-dashboard.json").read_text()
)
# Read from GPM, between two readings, on GPUs that have it (Hopper and newer) only.
GPM_ONLY = ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",)
# Grafana's own variables, as it sets them for a 1 s scrape interval.
GRAFANA_VARIABLES = {"__rate_interval": "4s", "__interval": "1s"}
MIB = 1 << 20
WHOLE_MIB_GPU = 2
"""The GPU whose memory in use is set to a whole number of MiB."""
DEADLINE_S = 20.0


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # rows hold panels of their own


QUERIES = [
    pytest.param(target["expr"], id=f"{panel['title']}/{target.get('refId', '')}")
    for panel in _panels(DASHBOARD["panels"])
    for target in panel.get("targets", [])
    if target.get("expr")
]
SERVED = [q for q in QUERIES if not any(f in q.values[0] for f in GPM_ONLY)]
"""The queries every GPU answers."""
FROM_GPM = [q for q in QUERIES if q not in SERVED]
"""The queries only GPUs with GPM answer."""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process this module started: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(timeout=10)


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # found before any fork: no lookup in a child


def _dies_with_us() -> None:
    """Between fork and exec: SIGKILL when the test run dies, so no teardown is needed then."""
    _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _until(what: str, ready: Callable[[], Any], proc: subprocess.Popen[bytes], log: Path) -> Any:
    """Poll ``ready`` until it answers something true; fail past the deadline or if ``proc``
    ends."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        with contextlib.suppress(OSError, ValueError):
            answer = ready()
            if answer:
                return answer
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-2000:]
    pytest.fail(f"{what}: not within {DEADLINE_S:.0f} s (exit code {proc.poll()}).\n{tail}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class Scraped:
    """A Prometheus that has scraped gpukit serve at least once."""

    api: str
    target: str
    """gpukit serve's address: the ``instance`` label Prometheus gives its series."""
    machine: dict[str, Any]

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.api}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[str, float]:
        """An instant vector, keyed by each series' ``gpu`` label."""
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        return {r["metric"].get("gpu", ""): float(r["value"][1]) for r in data["result"]}


def _serve(machine: Path, tmp: Path, interval: str) -> tuple[subprocess.Popen[bytes], str]:
    """``gpukit serve`` on ``machine``, reading it every ``interval`` seconds, as a user starts
    it; its address."""
    log = tmp / "serve.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpukit", "serve", "--port", "0", "--interval", interval],
            stdout=subprocess.PIPE,
            stderr=err,
            env=subprocess_env(GPUKIT_FAKE_NVML=str(machine), GPUKIT_LOCK_DIR=str(tmp / "locks")),
            preexec_fn=_dies_with_us,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    proc.stdout.close()
    if "serving http://" not in line:
        _stop(proc)
        pytest.fail(f"gpukit serve did not start: {line!r}\n{log.read_text(errors='replace')}")
    return proc, line.split("serving http://", 1)[1].split("/", 1)[0]


def _prometheus(target: str, tmp: Path, started: list[subprocess.Popen[bytes]]) -> tuple[str, Path]:
    """A Prometheus scraping ``target`` every second, with its data in ``tmp``: its address
    once it answers, and its log. Each process it starts is added to ``started``."""
    config = tmp / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: gpukit, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    log = tmp / "prometheus.log"
    assert PROMETHEUS is not None
    for _ in range(3):  # the free port found can be taken by another process before it binds
        listen = f"127.0.0.1:{_free_port()}"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address={listen}",
                    "--log.level=warn",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=tmp,
                preexec_fn=_dies_with_us,
            )
        started.append(proc)
        deadline = time.monotonic() + DEADLINE_S
        while proc.poll() is None and time.monotonic() < deadline:
            ready = f"http://{listen}/-/ready"
            with contextlib.suppress(OSError), urllib.request.urlopen(ready, timeout=5) as answer:
                if answer.status == 200:
                    return f"http://{listen}", log
            time.sleep(0.05)
        if "address already in use" not in log.read_text(errors="replace"):
            break
        _stop(proc)
    _stop(proc)
    pytest.fail(f"Prometheus did not start (exit code {proc.poll()}).\n{log.read_text()[-2000:]}")


def _scraped(api: str) -> bool:
    """True once a scrape is stored: ``up`` is written with the scraped samples, in one commit
    (the targets page says "up" a moment before)."""
    query = urllib.parse.urlencode({"query": 'up{job="gpukit"} == 1'})
    with urllib.request.urlopen(f"{api}/api/v1/query?{query}", timeout=5) as answer:
        return bool(json.load(answer)["data"]["result"])


@contextmanager
def _scraping(tmp: Path, described: dict[str, Any], interval: str) -> Iterator[Scraped]:
    """gpukit serve on the ``described`` machine, and a Prometheus that has scraped it once."""
    machine = tmp / "machine.json"
    machine.write_text(json.dumps(described))
    started: list[subprocess.Popen[bytes]] = []
    try:
        serve, target = _serve(machine, tmp, interval)
        started.append(serve)
        api, log = _prometheus(target, tmp, started)
        _until("Prometheus scraping gpukit serve", lambda: _scraped(api), started[-1], log)
        yield Scraped(api, target, described)
    finally:
        for proc in reversed(started):
            _stop(proc)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    """The 8 A100s, read once (no GPM there, so nothing needs a second reading)."""
    described = json.loads((MACHINES / "server-8xA100-shared.json").read_text())
    described["gpus"][WHOLE_MIB_GPU]["memory_used"] = 3 * 1024 * MIB
    with _scraping(tmp_path_factory.mktemp("prometheus"), described, "3600") as done:
        yield done


@pytest.fixture(scope="module")
def scraped_hopper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    """The two H100s (one in MIG mode), read every second: GPM's value needs two readings."""
    described = json.loads((MACHINES / "server-2xH100-mig.json").read_text())
    with _scraping(tmp_path_factory.mktemp("prometheus-h100"), described, "1") as done:
        yield done


def _escape(value: str) -> str:
    """A value as Grafana writes it into a regex matcher: regex-escaped, inside a PromQL
    string (so each backslash doubled)."""
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value)


def _all(scraped: Scraped) -> dict[str, str]:
    """Each dashboard variable set to "All", from its ``label_values(metric, label)`` query."""
    values = dict(GRAFANA_VARIABLES)
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        query = query["query"] if isinstance(query, dict) else query
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query.strip())
        assert match, f"variable {variable['name']}: a query this test cannot run: {query}"
        metric, label = match.groups()
        found = scraped.get(f"/api/v1/label/{label}/values", **{"match[]": metric})
        if variable.get("allValue"):
            values[variable["name"]] = variable["allValue"]
        else:
            values[variable["name"]] = "(" + "|".join(_escape(v) for v in found) + ")"
    return values


def _as_grafana_sends(expr: str, scraped: Scraped) -> str:
    """``expr`` with its ``$name`` and ``${name}`` variables replaced; an unknown one fails."""
    values = _all(scraped)
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values[m.group(1) or m.group(2)], expr)


def test_the_dashboards_variables_list_the_instance_and_every_gpu(scraped: Scraped) -> None:
    values = _all(scraped)
    assert values["instance"] == "(" + _escape(scraped.target) + ")"
    assert values["gpu"] == "(" + "|".join(str(i) for i in range(8)) + ")"


@pytest.mark.parametrize("expr", SERVED)
def test_each_panel_shows_every_gpu(scraped: Scraped, expr: str) -> None:
    result = scraped.query(_as_grafana_sends(expr, scraped))
    aggregated = re.match(r"\s*(sum|avg|min|max|count)\s*\(", expr) is not None
    assert sorted(result) == ([""] if aggregated else [str(i) for i in range(8)])


@pytest.mark.parametrize("expr", FROM_GPM)
def test_the_tensor_core_panel_shows_no_data_on_gpus_without_gpm(
    scraped: Scraped, expr: str
) -> None:
    assert scraped.query(_as_grafana_sends(expr, scraped)) == {}


@pytest.mark.parametrize("expr", FROM_GPM)
def test_the_tensor_core_panel_shows_each_gpm_gpus_described_activity(
    scraped_hopper: Scraped, expr: str
) -> None:
    query = _as_grafana_sends(expr, scraped_hopper)
    # gpukit serve reads every second; its second reading is the first with a GPM value.
    shown = _until_answered(scraped_hopper, query)
    described = {
        str(g["index"]): g["tensor_active_percent"] / 100  # DCGM's ratio, 0..1
        for g in scraped_hopper.machine["gpus"]
        if g.get("tensor_active_percent") is not None
    }
    assert described == {"1": 0.0625}  # GPU 0, in MIG mode, is described without GPM
    assert shown == pytest.approx(described)


def _until_answered(scraped: Scraped, query: str) -> dict[str, float]:
    """The query's answer, once it has one."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        answer = scraped.query(query)
        if answer:
            return answer
        time.sleep(0.2)
    pytest.fail(f"{query}: no data within {DEADLINE_S:.0f} s")


def test_the_dashboard_has_seven_queries_every_gpu_answers_and_one_from_gpm() -> None:
    assert len(SERVED) == 7
    assert [q.values[0] for q in FROM_GPM] == [
        'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}'
    ]


@pytest.mark.parametrize(
    ("dcgm", "gpukit"),
    [
        ("DCGM_FI_DEV_GPU_UTIL", "gpukit_gpu_utilization_ratio * 100"),
        ("DCGM_FI_DEV_GPU_TEMP", "gpukit_gpu_temperature_celsius"),
        ("DCGM_FI_DEV_POWER_USAGE", "gpukit_gpu_power_watts"),
        ("sum(DCGM_FI_DEV_POWER_USAGE)", "sum(gpukit_gpu_power_watts)"),
    ],
)
def test_panel_values_agree_with_gpukits_own_metrics(
    scraped: Scraped, dcgm: str, gpukit: str
) -> None:
    theirs, ours = scraped.query(dcgm), scraped.query(gpukit)
    assert theirs.keys() == ours.keys()
    assert theirs == pytest.approx(ours)


def test_framebuffer_panel_is_gpukits_memory_in_whole_mib(scraped: Scraped) -> None:
    used_mib = scraped.query("DCGM_FI_DEV_FB_USED")
    used_bytes = scraped.query("gpukit_gpu_memory_used_bytes")
    assert used_mib.keys() == used_bytes.keys() == {str(i) for i in range(8)}
    for gpu, mib in used_mib.items():
        assert mib * MIB <= used_bytes[gpu] < (mib + 1) * MIB, gpu
    assert used_mib[str(WHOLE_MIB_GPU)] * MIB == used_bytes[str(WHOLE_MIB_GPU)] == 3 << 30


def test_sm_clock_panel_shows_each_gpus_clock_in_hertz(scraped: Scraped) -> None:
    [expr] = [q.values[0] for q in SERVED if "DCGM_FI_DEV_SM_CLOCK" in q.values[0]]
    hertz = scraped.query(_as_grafana_sends(expr, scraped))
    assert hertz == {str(g["index"]): g["clock_sm_mhz"] * 1e6 for g in scraped.machine["gpus"]}


def test_memory_clock_is_each_gpus_memory_clock(scraped: Scraped) -> None:
    assert scraped.query("DCGM_FI_DEV_MEM_CLOCK") == {
        str(g["index"]): g["clock_mem_mhz"] for g in scraped.machine["gpus"]
    }
