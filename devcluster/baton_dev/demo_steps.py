"""Readable progress for the demo: numbered steps with their duration, mirrored to a log file."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO


class DemoFailed(RuntimeError):
    """A demo step failed; the message says which and where its logs are."""


class Progress:
    """Prints ``[n/total] what`` and ``done in X s`` per step, and keeps a copy in a log file."""

    def __init__(self, total: int, log_file: Path | None = None, out: TextIO = sys.stdout) -> None:
        self.total = total
        self.number = 0
        self.out = out
        self.log_file = log_file
        self.started = time.monotonic()

    def attach_log(self, log_file: Path) -> None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = log_file

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)
        if self.log_file is not None:
            with self.log_file.open("a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} {text}\n")

    @contextmanager
    def step(self, what: str, logs: str = "") -> Iterator[None]:
        self.number += 1
        self.say(f"[{self.number}/{self.total}] {what}" + (f"  (logs: {logs})" if logs else ""))
        began = time.monotonic()
        try:
            yield
        except BaseException:
            self.say(f"      FAILED after {time.monotonic() - began:.1f} s")
            raise
        self.say(f"      done in {time.monotonic() - began:.1f} s")

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started
