"""The HTTP side of ``gpukit serve``: the dashboard, its JSON, and ``/metrics``.

Built on the standard library's ThreadingHTTPServer: every answer is bytes the sampler already
rendered, so a request needs no framework, only a thread that writes them. That keeps the
``serve`` extra to prometheus_client alone and the server startable in-process on port 0 (tests).

>>> server = DashboardServer(("127.0.0.1", 0), Sampler(interval=2))   # doctest: +SKIP
>>> server.start(); print(server.url); server.close()                 # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpukit.errors import InvalidArgumentError
from gpukit.serve.sampler import Sampler

_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/app.css": ("app.css", "text/css; charset=utf-8"),
}
_JSON = "application/json"
# The page loads only its own files: a user or command name shown on it can never run as code.
# No other site may frame it either.
_CSP = (
    "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
_SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": _CSP,
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
MAX_CONNECTIONS = 256
"""Connections answered at once, one thread each; more are answered 503 and closed at once."""
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n"
    b"Retry-After: 1\r\n\r\n"
)


def _static(name: str) -> bytes:
    return resources.files("gpukit.serve").joinpath("static").joinpath(name).read_bytes()


_WRONG_HOST = (
    b"gpukit serve listens on this machine only and answers only to its loopback names "
    b"(127.0.0.1, localhost), so that no web page can read it through a name it controls.\n"
)


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    protocol_version = "HTTP/1.1"
    timeout = 60  # a client that sends nothing does not keep a thread forever

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def _answer(self, *, head: bool) -> None:
        path = self.path.split("?", 1)[0]
        found = self.server.page(path)
        if not self.server.accepts_host(self.headers.get("Host")):
            self._send(HTTPStatus.FORBIDDEN, _WRONG_HOST, "text/plain; charset=utf-8", head)
        elif found is None:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8", head)
        else:
            body, kind = found
            self._send(HTTPStatus.OK, body, kind, head)

    def _send(self, status: HTTPStatus, body: bytes, kind: str, head: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # A request line that does not parse leaves the HTTP/0.9 default, under which the
        # standard library sends a bare page: answer with a status line and headers instead.
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        super().send_error(code, message, explain)

    def end_headers(self) -> None:
        # Here rather than in _send: the standard library's own answers (400, 414, 431, 501
        # from send_error) carry them too.
        for name, value in _SECURITY_HEADERS.items():
            self.send_header(name, value)
        super().end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a dashboard polled every few seconds would flood the log


class DashboardServer(ThreadingHTTPServer):
    """Serves ``sampler``'s last sample on ``address`` until :meth:`close`.

    Args:
        address: the host and port to listen on.
        sampler: the sampler whose last reading is served.
        max_connections: connections served at once at most; more are answered 503 and
            closed.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], sampler: Sampler, *, max_connections: int = MAX_CONNECTIONS
    ) -> None:
        if isinstance(max_connections, bool) or not isinstance(max_connections, int):
            max_connections = -1  # refused below, with the others
        if max_connections < 1:
            raise InvalidArgumentError(
                "DashboardServer(max_connections=...) must be a whole number from 1: with no "
                "connection allowed, every request would be answered 503.",
                hint=f"Leave it out ({MAX_CONNECTIONS} at once) or pass a positive int.",
            )
        host, port = address
        self._slots = threading.BoundedSemaphore(max_connections)
        try:
            self.address_family = (
                socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
            )
        except ValueError:
            self.address_family = socket.AF_INET
        try:
            super().__init__(address, _Handler)
        except OSError as exc:
            why = "that port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise InvalidArgumentError(
                f"Cannot serve on {host}:{port}: {why}.",
                hint="Choose another --port (0 lets the system pick a free one), or a --host "
                "this machine has.",
            ) from exc
        self.sampler = sampler
        self.loopback = is_loopback(host)
        self._static = {path: (_static(name), kind) for path, (name, kind) in _STATIC.items()}
        self._thread: threading.Thread | None = None

    def process_request(self, request: Any, client_address: Any) -> None:
        """Answer ``request`` on its own thread, unless ``max_connections`` are open already:
        then say 503 and close it at once, so that no number of clients can make the server
        hold more threads than that.

        Args:
            request: the accepted connection's socket.
            client_address: the client's address, as ``accept()`` returned it.
        """
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.setblocking(False)
                request.send(_BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # no thread started: it will not release its slot
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Answer ``request`` on this thread, then give its connection slot back.

        Args:
            request: the accepted connection's socket.
            client_address: the client's address, as ``accept()`` returned it.
        """
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def accepts_host(self, header: str | None) -> bool:
        """Whether to answer a request whose ``Host`` header is ``header``.

        On a loopback address only loopback names and this machine's own host name are
        answered (and a request without the header, as HTTP/1.0 allows): a web page in the
        user's browser could otherwise point a name it controls at 127.0.0.1 (DNS rebinding)
        and read the user names and command lines the page shows. Served on another address,
        the admin chose who may reach it, and any name is answered.

        Args:
            header: the request's ``Host`` header, or None when it had none.
        """
        if not self.loopback or header is None:
            return True
        name = header.strip().lower()
        if not name.endswith("]"):
            name = name.rsplit(":", 1)[0]  # drop the port; an IPv6 address comes in brackets
        name = name.strip("[]")
        return is_loopback(name) or name == socket.gethostname().lower()

    @property
    def url(self) -> str:
        """``http://HOST:PORT/``, with the port the system chose when asked for port 0."""
        host, port = self.server_address[:2]
        text = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{text}]" if ":" in text else text
        return f"http://{shown}:{port}/"

    def page(self, path: str) -> tuple[bytes, str] | None:
        """The body and content type served at ``path``, or None for an unknown path.

        Args:
            path: the request's path, query left out.
        """
        if path in self._static:
            return self._static[path]
        sample = self.sampler.latest
        if path == "/metrics":
            return sample.metrics, CONTENT_TYPE_LATEST
        if path == "/api/inventory":
            return sample.inventory_json, _JSON
        if path == "/api/queue":
            return sample.queue_json, _JSON
        if path == "/api/state":
            return sample.state_json, _JSON
        return None

    def start(self) -> None:
        """Answer requests on a background thread."""
        self._thread = threading.Thread(
            target=self.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="gpukit-http",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Stop answering and release the port."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self.server_close()


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost).

    Args:
        host: a host name or address.
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
