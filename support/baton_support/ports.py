"""Free loopback ports for servers a test starts and tells which port to bind."""

from __future__ import annotations

import random
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


def free_port_range(count: int) -> int:
    """The first of `count` consecutive TCP ports free on 127.0.0.1 a moment ago (a
    tensor-parallel producer's ranks bind ``kv_transfer_port + rank``), none handed out before.

    Drawn below the kernel's ephemeral range (32768 and up on Linux): `free_port`'s ports and
    outgoing connections take theirs from that range, and a port just above one of them is
    likely the next one taken.
    """
    rng = random.Random()
    with _lock:
        while True:
            base = rng.randrange(20000, 32768 - count)
            ports = range(base, base + count)
            if any(p in _handed_out for p in ports):
                continue
            sockets = [socket.socket() for _ in ports]
            try:
                for sock, port in zip(sockets, ports, strict=True):
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            finally:
                for sock in sockets:
                    sock.close()
            _handed_out.update(ports)
            return base


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
