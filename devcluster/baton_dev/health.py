"""Waiting for a component's health endpoint, with a deadline and a clear failure."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable

import httpx

from baton_dev.processes import ProcessRecord, is_alive


class ComponentFailed(RuntimeError):
    pass


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_until(
    what: str, check: Callable[[], bool], timeout_s: float, process: ProcessRecord | None = None
) -> None:
    """Poll `check` until it is true; fail early if `process` dies, else at the deadline."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        if check():
            return
        if process is not None and not is_alive(process):
            raise ComponentFailed(
                f"{process.name} exited while waiting for {what}; log {process.log}:\n{_tail(process.log)}"
            )
        if time.monotonic() > deadline:
            hint = f"; log {process.log}:\n{_tail(process.log)}" if process else ""
            raise ComponentFailed(f"timed out after {timeout_s:.0f} s waiting for {what}{hint}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


def http_ok(url: str, ca_file: str | None = None, token: str | None = None) -> Callable[[], bool]:
    """GET url answers 200 (TLS verified against ca_file if given; the controller manager's and
    scheduler's self-signed serving certs are not checked)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else False

    def check() -> bool:
        try:
            return httpx.get(url, verify=verify, headers=headers, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    return check
