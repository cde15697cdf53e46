"""Free loopback ports for servers a test starts and tells which port to bind."""

from __future__ import annotations

import socket
import threading

_handed_out: set[int] = set()
_lock = threading.Lock()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 a moment ago, never one this process handed out before.

    The port is closed again before the caller's server binds it (often seconds later, after its
    imports), and the kernel may offer a closed port to the next ``bind(0)``: without the memory,
    two servers started together could both be told the same port.
    """
    with _lock:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def bound_socket() -> socket.socket:
    """A TCP socket bound to a free 127.0.0.1 port (SO_REUSEADDR), for a server in this process.

    Never a port `free_port` handed out: a port a test keeps free as a dead endpoint stays dead.
    """
    with _lock:
        while True:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            if sock.getsockname()[1] not in _handed_out:
                return sock
            sock.close()
