"""What serve answers to malformed requests and to more clients than it serves at once."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpukit.serve import DashboardServer

_HEADERS = ("Content-Security-Policy", "X-Content-Type-Options", "Cache-Control")


def _exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw`` and read the answer until the server closes (at most 10 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(raw)
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _headers(answer: bytes) -> tuple[int, dict[str, str]]:
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in head[1:])
    return int(head[0].split()[1]), fields


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET / HTTP/1.x\r\n\r\n", 400),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(120)) + b"\r\n", 431),
        (b"BREW / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 501),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
    ],
)
def test_the_standard_librarys_error_pages_carry_the_security_headers(
    serve_machine: Any, raw: bytes, status: int
) -> None:
    served = serve_machine("server-8xA100-shared")
    got, fields = _headers(_exchange(served.server.server_address[1], raw))
    assert got == status
    for name in _HEADERS:
        assert name in fields, name
    assert "default-src 'self'" in fields["Content-Security-Policy"]
    assert fields["X-Content-Type-Options"] == "nosniff"


@pytest.fixture
def small_server(serve_machine: Any) -> Iterator[DashboardServer]:
    served = serve_machine("server-8xA100-shared")
    server = DashboardServer(("127.0.0.1", 0), served.sampler, max_connections=3)
    server.start()
    yield server
    server.close()


def _get_metrics(port: int) -> int:
    answer = _exchange(
        port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    return _headers(answer)[0]


def test_connections_past_the_bound_are_answered_503_and_closed_at_once(
    small_server: DashboardServer,
) -> None:
    port = small_server.server_address[1]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    try:
        started = time.monotonic()
        answer = _exchange(port, b"")  # a 4th client, sending nothing: not kept waiting
        assert _headers(answer)[0] == 503
        assert time.monotonic() - started < 5
    finally:
        for conn in idle:
            conn.close()


def test_the_server_answers_again_once_the_idle_clients_leave(
    small_server: DashboardServer,
) -> None:
    port = small_server.server_address[1]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    assert _get_metrics(port) == 503
    for conn in idle:
        conn.close()
    deadline = time.monotonic() + 10
    status = _get_metrics(port)
    while status == 503 and time.monotonic() < deadline:  # their threads end as they see EOF
        time.sleep(0.05)
        status = _get_metrics(port)
    assert status == 200


@pytest.mark.parametrize("limit", [0, -1, True, 2.5], ids=["0", "-1", "True", "2.5"])
def test_a_limit_that_would_serve_nobody_is_refused(serve_machine: Any, limit: object) -> None:
    from gpukit.errors import InvalidArgumentError

    served = serve_machine("server-8xA100-shared")
    with pytest.raises(InvalidArgumentError, match="max_connections"):
        DashboardServer(("127.0.0.1", 0), served.sampler, max_connections=limit)  # type: ignore[arg-type]
