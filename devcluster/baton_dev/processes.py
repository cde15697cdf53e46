"""Start and stop the cluster's processes by pid, never by name. A pid is only signalled while its
start time (from /proc) still matches the one recorded, so a reused pid is never hit."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessRecord:
    name: str
    pid: int
    start_ticks: int
    log: str

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "pid": self.pid, "start_ticks": self.start_ticks, "log": self.log}

    @staticmethod
    def from_json(data: dict[str, object]) -> ProcessRecord:
        return ProcessRecord(
            name=str(data["name"]),
            pid=int(str(data["pid"])),
            start_ticks=int(str(data["start_ticks"])),
            log=str(data["log"]),
        )


def start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks), None if the pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None  # a zombie has already exited
    return int(fields[19])


def is_alive(record: ProcessRecord) -> bool:
    return start_ticks(record.pid) == record.start_ticks


def spawn(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> ProcessRecord:
    """Start argv in its own session (so it outlives the CLI), stdout+stderr to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    ticks = start_ticks(proc.pid)
    if ticks is None:
        raise RuntimeError(f"{name} exited at once; see {log}")
    # Popen objects are dropped: the CLI exits after `up`. Reap later children via os.waitpid.
    return ProcessRecord(name=name, pid=proc.pid, start_ticks=ticks, log=str(log))


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop(record: ProcessRecord, grace_s: float = 5.0) -> bool:
    """SIGTERM the process group, SIGKILL after grace_s. True if it was running."""
    _reap(record.pid)
    if not is_alive(record):
        return False
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(record.pid, sig)  # spawn() made the pid its own group leader
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _reap(record.pid)
            if not is_alive(record):
                return True
            time.sleep(0.02)
    raise RuntimeError(f"{record.name} (pid {record.pid}) survived SIGKILL")
