"""Process checks for tensor-parallel tests: rank processes must never outlive their engine."""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path


def children(pid: int) -> list[int]:
    """Live (not zombie) child processes of `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ")".
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.append(int(entry.name))
    return sorted(found)


def live_children(before: Collection[int] = ()) -> list[int]:
    """Live child processes of this test process not in `before`: in a full run the session's
    local control plane (etcd, the API server, kwok...) started by earlier tests are children of
    pytest too, so a test compares against what it found when it began."""
    known = set(before)
    return [pid for pid in children(os.getpid()) if pid not in known]
