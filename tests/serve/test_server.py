"""The HTTP answers of gpukit serve: JSON documents, /metrics, the page's own files."""

from __future__ import annotations

import http.client
import json
import os
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest

from gpukit.gpus.inventory import SCHEMA, Inventory
from gpukit.serve import DashboardServer, History, Sampler, is_loopback
from gpukit.sharing.claims import claim
from gpukit.sharing.tickets import Ticket

A100_4 = "GPU-a170b338-3926-3059-f28c-105d1fb17c23"


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.status, dict(answer.headers), answer.read()


def test_api_inventory_reads_back_as_the_machine(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    status, headers, body = _get(served.url + "api/inventory")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    data = json.loads(body)
    assert data["schema"] == SCHEMA
    inv = Inventory.from_json(data)
    assert [g.index for g in inv.gpus] == list(range(8))
    assert inv.gpus[3].processes[0].user == "bob"


def test_api_queue_serves_the_queue_snapshot_with_holders_and_waiters(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    with claim([A100_4], command="python sweep.py"), Ticket():
        served.sampler.sample()
        data = json.loads(_get(served.url + "api/queue")[2])
    assert data["schema"] == "gpukit.queue/1"
    [held] = data["holders"]
    assert (held["gpus"], held["command"], held["pid"]) == ([4], "python sweep.py", os.getpid())
    [waiter] = data["waiters"]
    assert (waiter["position"], waiter["pid"]) == (1, os.getpid())


def test_metrics_are_served_in_the_prometheus_text_format(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    status, headers, body = _get(served.url + "metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=")
    assert b'gpukit_gpu_temperature_celsius{gpu="6"} 71.0' in body


def test_the_page_and_its_files_come_from_the_package(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    status, headers, page = _get(served.url)
    assert status == 200
    assert headers["Content-Type"].startswith("text/html")
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    assert b'src="/static/app.js"' in page
    assert b"http" not in page.replace(b"http-equiv", b"")  # nothing from another site
    assert _get(served.url + "static/app.js")[1]["Content-Type"].startswith("text/javascript")
    assert _get(served.url + "static/app.css")[1]["Content-Type"].startswith("text/css")


@pytest.mark.parametrize("path", ["nope", "static/../sampler.py", "static/index.html.bak"])
def test_unknown_paths_are_not_found(serve_machine: Any, path: str) -> None:
    served = serve_machine("server-8xA100-shared")
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(served.url + path)
    assert err.value.code == 404


def test_a_scrape_during_a_slow_reading_answers_from_the_last_sample(
    serve_machine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve_machine("server-8xA100-shared")
    reading, release = threading.Event(), threading.Event()
    real_read = served.sampler._read

    def slow_read() -> Inventory:
        reading.set()
        release.wait(30)
        return real_read()

    monkeypatch.setattr(served.sampler, "_read", slow_read)
    sampling = threading.Thread(target=served.sampler.sample)
    sampling.start()
    try:
        assert reading.wait(10)
        conn = http.client.HTTPConnection("127.0.0.1", served.server.server_address[1], timeout=5)
        conn.request("GET", "/metrics")
        answer = conn.getresponse()
        assert answer.status == 200
        assert b"gpukit_gpu_info" in answer.read()
        conn.close()
    finally:
        release.set()
        sampling.join()


def test_a_port_in_use_is_refused_with_a_usage_error(serve_machine: Any) -> None:
    from gpukit.errors import InvalidArgumentError

    served = serve_machine("server-8xA100-shared")
    port = served.server.server_address[1]
    with pytest.raises(InvalidArgumentError, match=f"127.0.0.1:{port}: that port is in use"):
        DashboardServer(("127.0.0.1", port), served.sampler)


@pytest.mark.parametrize("interval", [0, -1, float("nan"), float("inf")])
def test_sampler_refuses_an_interval_that_is_not_a_positive_time(interval: float) -> None:
    from gpukit.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="--interval"):
        Sampler(interval)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("192.168.1.4", False),
        ("gpu-server", False),
    ],
)
def test_only_loopback_addresses_count_as_private(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def _inventory(t: float, util: int | None, used: int) -> Inventory:
    from gpukit.gpus.inventory import GPU

    gpu = GPU(
        index=0, uuid="GPU-a", name="T", memory_total=100, memory_used=used, utilization_gpu=util
    )
    return Inventory(gpus=(gpu,), taken_at=t)


def test_history_charts_bucket_means_over_the_last_hour() -> None:
    history = History(span_s=60)
    history.add(_inventory(1000, 10, 50))  # falls out of the hour once t=1070 arrives
    history.add(_inventory(1070, 20, 10))
    history.add(_inventory(1080, 40, 30))
    history.add(_inventory(1125, None, 40))
    chart = history.chart(now=1130, points=4)  # buckets of 15 s from 1070
    assert chart["gpus"]["GPU-a"]["util"] == [pytest.approx(0.3), None, None, None]
    assert chart["gpus"]["GPU-a"]["memory"] == [pytest.approx(0.2), None, None, 0.4]


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("127.0.0.1:9400", 200),
        ("localhost:9400", 200),
        ("[::1]:9400", 200),
        ("LOCALHOST", 200),
        ("attacker.example:9400", 403),
        ("127.0.0.1.attacker.example", 403),
    ],
)
def test_a_loopback_server_answers_only_to_loopback_names(
    serve_machine: Any, host: str, status: int
) -> None:
    served = serve_machine("server-8xA100-shared")
    conn = http.client.HTTPConnection("127.0.0.1", served.server.server_address[1], timeout=5)
    try:
        conn.request("GET", "/api/inventory", headers={"Host": host})
        answer = conn.getresponse()
        body = answer.read()
    finally:
        conn.close()
    assert answer.status == status
    assert (b"alice" in body) is (status == 200)
