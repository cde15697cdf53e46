"""The 127.<k>.0.0/16 one local cluster's process nodes take pod IPs from (node n gets
127.<k>.<n>.0/24), distinct from every other cluster running on the host.

Loopback addresses are shared by the whole host, so a range is claimed with an exclusive lock on
a host-wide lock file, held by the node agent for as long as it runs; the kernel drops the lock
when the agent exits, however it exits, so a crashed cluster leaves no stale claim.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import tempfile
from pathlib import Path

#: Second octets a cluster may claim: 127.0/16 holds the host's own services (127.0.0.1), 127.1/16
#: the kwok nodes' fake pod IPs, and 127.2/16 is what every cluster used before ranges were
#: claimed (a cluster started from an older checkout takes it without a lock).
FIRST_OCTET, LAST_OCTET = 3, 254
#: Node indexes a range can address (a /24 each); ClusterSpec allows at most 250 process nodes.
MAX_NODES = 256


def default_lock_dir() -> Path:
    """Host-wide, whoever's cluster it is: every user's clusters share the loopback addresses."""
    return Path(tempfile.gettempdir()) / "baton-dev-pod-ranges"


class PodRange:
    """A claimed 127.<octet>.0.0/16; `close` (or the agent's exit) gives it back."""

    def __init__(self, octet: int, lock_fd: int) -> None:
        self.octet = octet
        self._lock_fd: int | None = lock_fd

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"127.{self.octet}.0.0/16")

    def node_cidr(self, index: int) -> str:
        if not 0 <= index < MAX_NODES:
            raise ValueError(f"process node index {index}: must be between 0 and {MAX_NODES - 1}")
        return f"127.{self.octet}.{index}.0/24"

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None

    def __enter__(self) -> PodRange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_lock_dir(lock_dir: Path) -> None:
    try:
        lock_dir.mkdir(parents=True)
    except FileExistsError:
        return
    # Other users' agents must be able to add their lock files (sticky: none can remove another's).
    with contextlib.suppress(OSError):
        lock_dir.chmod(0o1777)


def claim_pod_range(lock_dir: Path | None = None) -> PodRange:
    """The lowest range no running cluster holds. Raises RuntimeError when all are held."""
    lock_dir = lock_dir or default_lock_dir()
    _open_lock_dir(lock_dir)
    for octet in range(FIRST_OCTET, LAST_OCTET + 1):
        path = lock_dir / f"127.{octet}.lock"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o444)
        except PermissionError:
            continue  # another user's file we may not open: treat the range as theirs
        try:
            # flock locks belong to the open file, so two claims in one process exclude each other.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return PodRange(octet, fd)
    raise RuntimeError(
        f"no free pod IP range: 127.{FIRST_OCTET}-{LAST_OCTET}.0.0/16 are all held by running "
        f"clusters (lock files in {lock_dir})"
    )
