"""Real HTTP servers on loopback for the router tests: uvicorn in a thread, on a free port."""

from __future__ import annotations

import threading
from typing import Any

import uvicorn

from baton_support.ports import bound_socket, free_port
from baton_support.wait import wait_for


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
        wait_for(lambda: self.server.started or not self._thread.is_alive(), message=f"server on {self.url}")
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
