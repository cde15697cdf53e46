"""Real HTTP servers on 127.0.0.1 that answer /metrics well, badly, slowly or never."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Behaviour = Callable[["MetricsServer", BaseHTTPRequestHandler], None]


class MetricsServer:
    """One server thread; ``stop()`` releases any held request, shuts down and closes the socket."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.release = threading.Event()  # hung handlers wait on this
        self.lock = threading.Condition()
        self.in_flight = 0
        self.max_in_flight = 0
        self.arrived = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.behaviour(owner, self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, args=(0.05,), name="metrics-server", daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}/metrics"

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


def answer(status: int, body: str) -> Behaviour:
    def behave(server: MetricsServer, handler: BaseHTTPRequestHandler) -> None:
        data = body.encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "text/plain; version=0.0.4")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    return behave


def hang(server: MetricsServer, handler: BaseHTTPRequestHandler) -> None:
    """Accept the request, never answer (until the test stops the server)."""
    server.release.wait(timeout=30)


def trickle(server: MetricsServer, handler: BaseHTTPRequestHandler) -> None:
    """Answer at once, then one byte every 50 ms: every read is quick, the whole answer is not."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/plain; version=0.0.4")
    handler.end_headers()
    try:
        while not server.release.is_set():
            handler.wfile.write(b"#")
            handler.wfile.flush()
            time.sleep(0.05)
    except (BrokenPipeError, ConnectionResetError):
        pass


def held(body: str, total: int, hold_s: float) -> Behaviour:
    """Hold each request until all ``total`` have arrived, or ``hold_s`` passed: an unbounded
    client gets all of them in flight at once; a client bounded to N shows a peak of exactly N
    (the rest cannot arrive while N are held, which is what the hold proves)."""

    def behave(server: MetricsServer, handler: BaseHTTPRequestHandler) -> None:
        with server.lock:
            server.arrived += 1
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
            server.lock.notify_all()
            server.lock.wait_for(lambda: server.arrived >= total, timeout=hold_s)
            # Leave before answering: the client may send its next request only after the answer.
            server.in_flight -= 1
        answer(200, body)(server, handler)

    return behave
