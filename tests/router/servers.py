"""Real HTTP servers on loopback for the router tests: uvicorn in a thread, on a free port."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from baton_support.ports import bound_socket, free_port


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def dead_url() -> str:
    """A loopback URL nobody listens on (bound then closed: connections are refused)."""
    return f"http://127.0.0.1:{free_port()}"


class ServerThread:
    """Runs an ASGI app under uvicorn on 127.0.0.1 in a daemon thread."""

    def __init__(self, app: Any, *, lifespan: str = "off") -> None:
        self._sock = bound_socket()
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan=lifespan)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        wait_for(lambda: self.server.started or not self._thread.is_alive(), what=f"server on {self.url}")
        if not self.server.started:
            raise RuntimeError(f"server on {self.url} failed to start")
        return self

    def stop(self) -> None:
        self.request_stop()
        self._thread.join(timeout=10)
        self._sock.close()
        if self._thread.is_alive():
            raise RuntimeError(f"server on {self.url} did not stop")

    def request_stop(self) -> None:
        self.server.should_exit = True


def stop_all(servers: list[ServerThread]) -> None:
    """Stop several servers at once (each takes a few tenths of a second to wind down)."""
    for server in servers:
        server.request_stop()
    for server in servers:
        server.stop()
