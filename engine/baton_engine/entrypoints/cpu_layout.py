"""Where a CPU engine's processes run: how many intra-op threads the engine core uses and which
CPUs it and the HTTP server are pinned to.

A served engine is two processes: the HTTP server (tokenizing, detokenizing, streaming every
token) and the engine core (the model). By default (``cpu_bind=none``) nothing is pinned and the
core takes one thread per usable CPU: the CPUs of its affinity mask, or its cgroup CPU quota when
that is narrower (a Kubernetes pod with a CPU limit on a big node would otherwise start one thread
per node core and be throttled). ``cpu_bind=split`` gives the server the first CPU and the core
one thread on each of the others (vLLM-CPU's default layout), when the process owns its CPUs (its
mask is no wider than its quota): the server's bursts and one busy neighbour then never preempt a
compute thread, at the price of the server's CPU, which Baton's light server leaves mostly idle
(measured on 2 cores: half the throughput, prefill being compute-bound).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuLayout:
    """The plan for one served engine on CPU."""

    core_threads: int
    """Intra-op (torch/OpenMP) threads of the engine core."""
    core_cpus: tuple[int, ...] | None
    """CPUs the engine core is pinned to; None: not pinned."""
    server_cpus: tuple[int, ...] | None
    """CPUs the HTTP server is pinned to; None: not pinned."""


def plan_cpu_layout(
    allowed: Sequence[int],
    quota: float | None,
    threads: int | None,
    bind: Literal["split", "none"],
) -> CpuLayout:
    """The layout for a process allowed on `allowed` CPUs under a cgroup quota of `quota` CPUs
    (None: unlimited), with `threads` asked for explicitly (None: one per CPU the core gets)."""
    cpus = tuple(sorted(set(allowed)))
    if not cpus:
        raise ValueError("no CPU allowed")
    usable = len(cpus) if quota is None else max(1, min(len(cpus), math.ceil(quota)))
    owns_its_cpus = quota is None or len(cpus) <= quota + 1e-9
    if bind == "split" and owns_its_cpus and len(cpus) >= 2 and (threads is None or threads <= len(cpus) - 1):
        return CpuLayout(core_threads=threads or len(cpus) - 1, core_cpus=cpus[1:], server_cpus=cpus[:1])
    return CpuLayout(core_threads=threads or usable, core_cpus=None, server_cpus=None)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (cgroup v2 ``cpu.max``, else v1's CFS
    quota and period); None when unlimited or unknown."""
    try:
        text = (root / "cpu.max").read_text().split()
        if len(text) == 2 and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def explicit_threads(cpu_threads: int | None, environ: Mapping[str, str]) -> int | None:
    """The thread count asked for: the engine's setting, else OMP_NUM_THREADS (as torch reads it)."""
    if cpu_threads is not None:
        return cpu_threads
    value = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def host_cpu_layout(cpu_threads: int | None, bind: Literal["split", "none"]) -> CpuLayout:
    """`plan_cpu_layout` for this process, as it runs now."""
    return plan_cpu_layout(
        sorted(os.sched_getaffinity(0)),
        cgroup_cpu_quota(),
        explicit_threads(cpu_threads, os.environ),
        bind,
    )
