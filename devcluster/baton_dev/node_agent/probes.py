"""One probe attempt (httpGet, tcpSocket, exec) against a pod's process, with the spec's timeout."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass

import httpx

from baton_dev.kubeapi import JsonObject


@dataclass(frozen=True)
class ProbeTiming:
    initial_delay_s: float
    period_s: float
    timeout_s: float
    success_threshold: int
    failure_threshold: int

    @staticmethod
    def of(probe: JsonObject) -> ProbeTiming:
        return ProbeTiming(
            initial_delay_s=float(probe.get("initialDelaySeconds", 0)),
            period_s=float(probe.get("periodSeconds", 10)),
            timeout_s=float(probe.get("timeoutSeconds", 1)),
            success_threshold=int(probe.get("successThreshold", 1)),
            failure_threshold=int(probe.get("failureThreshold", 3)),
        )


def resolve_port(port: int | str, container: JsonObject) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"probe port {port!r} is not a named port of container {container['name']!r}")


async def run_probe(
    probe: JsonObject, container: JsonObject, pod_ip: str, env: dict[str, str], cwd: str
) -> tuple[bool, str]:
    """(success, message)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            return await _http(probe["httpGet"], container, pod_ip, timeout)
        if "tcpSocket" in probe:
            return await _tcp(probe["tcpSocket"], container, pod_ip, timeout)
        if "exec" in probe:
            return await _exec(probe["exec"].get("command") or [], env, cwd, timeout)
    except ValueError as e:
        return False, str(e)
    return False, f"unsupported probe handler {sorted(k for k in probe if k[0].islower())}"


async def _http(action: JsonObject, container: JsonObject, pod_ip: str, timeout: float) -> tuple[bool, str]:
    scheme = str(action.get("scheme", "HTTP")).lower()
    host = action.get("host") or pod_ip
    port = resolve_port(action["port"], container)
    path = action.get("path", "/")
    if not path.startswith("/"):
        path = "/" + path
    headers = {h["name"]: h["value"] for h in action.get("httpHeaders") or []}
    headers.setdefault("User-Agent", "kube-probe/1.36")
    url = f"{scheme}://{host}:{port}{path}"
    try:
        async with httpx.AsyncClient(verify=False, timeout=timeout, follow_redirects=False) as client:
            response = await client.get(url, headers=headers)
    except httpx.HTTPError as e:
        return False, f"GET {url}: {type(e).__name__}: {e}"
    if 200 <= response.status_code < 400:
        return True, ""
    return False, f"GET {url}: HTTP probe failed with statuscode: {response.status_code}"


async def _tcp(action: JsonObject, container: JsonObject, pod_ip: str, timeout: float) -> tuple[bool, str]:
    host = action.get("host") or pod_ip
    port = resolve_port(action["port"], container)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError) as e:
        return False, f"dial tcp {host}:{port}: {e or 'timeout'}"
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True, ""


async def _exec(command: list[str], env: dict[str, str], cwd: str, timeout: float) -> tuple[bool, str]:
    if not command:
        return False, "exec probe without a command"
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            env=env,
            cwd=cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as e:
        return False, f"exec {command[0]}: {e}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
        return False, f"command {command!r} timed out after {timeout:g} s"
    if proc.returncode == 0:
        return True, ""
    return False, f"command {command!r} exited with {proc.returncode}: {out.decode(errors='replace')[-200:]}"
