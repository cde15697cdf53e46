"""The CPU layout of a served engine: the pure plan (a table), the cgroup quota as the kernel
writes it (v2 and v1 files), OMP_NUM_THREADS as torch reads it, and a real server whose engine
core runs where the plan says."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from baton_engine.entrypoints.cpu_layout import (
    CpuLayout,
    cgroup_cpu_quota,
    explicit_threads,
    host_cpu_layout,
    plan_cpu_layout,
)
from tests.server.server_process import ServerProcess


@pytest.mark.parametrize(
    ("allowed", "quota", "threads", "bind", "expected"),
    [
        # a 2-CPU machine of its own: server on CPU 0, one core thread on CPU 1
        ([0, 1], None, None, "split", CpuLayout(1, (1,), (0,))),
        ([3, 1, 2, 0], None, None, "split", CpuLayout(3, (1, 2, 3), (0,))),
        # exclusive CPUs of a Guaranteed pod (static CPU manager): the mask matches the quota
        ([4, 5, 6, 7], 4.0, None, "split", CpuLayout(3, (5, 6, 7), (4,))),
        # a CPU limit on a shared node: the mask is the node's, the quota decides the threads
        (list(range(64)), 2.0, None, "split", CpuLayout(2, None, None)),
        (list(range(64)), 2.5, None, "split", CpuLayout(3, None, None)),
        (list(range(64)), 0.5, None, "split", CpuLayout(1, None, None)),
        # one CPU: nothing to split
        ([2], None, None, "split", CpuLayout(1, None, None)),
        # explicit threads that fit beside the server's CPU are pinned; more are not
        ([0, 1, 2, 3], None, 2, "split", CpuLayout(2, (1, 2, 3), (0,))),
        ([0, 1], None, 2, "split", CpuLayout(2, None, None)),
        # bind none (the default): threads follow the CPUs (or the quota), nothing pinned
        ([0, 1], None, None, "none", CpuLayout(2, None, None)),
        (list(range(8)), 3.0, None, "none", CpuLayout(3, None, None)),
        ([0, 1], None, 5, "none", CpuLayout(5, None, None)),
        (list(range(64)), 2.0, None, "none", CpuLayout(2, None, None)),
    ],
)
def test_plan(
    allowed: list[int], quota: float | None, threads: int | None, bind: str, expected: CpuLayout
) -> None:
    assert plan_cpu_layout(allowed, quota, threads, bind) == expected  # type: ignore[arg-type]


def test_no_cpu_is_an_error() -> None:
    with pytest.raises(ValueError, match="no CPU allowed"):
        plan_cpu_layout([], None, None, "split")


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "250000 100000\n"}, 2.5),
        ({"cpu.max": "50000 100000\n"}, 0.5),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
        ({"cpu.max": "garbage\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_quota(tmp_path: Path, files: dict[str, str], expected: float | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(tmp_path) == expected


@pytest.mark.parametrize(
    ("setting", "environ", "expected"),
    [
        (None, {}, None),
        (None, {"OMP_NUM_THREADS": "3"}, 3),
        (None, {"OMP_NUM_THREADS": "4,2"}, 4),  # nested levels: the outer one is torch's
        (None, {"OMP_NUM_THREADS": "0"}, None),
        (None, {"OMP_NUM_THREADS": "many"}, None),
        (2, {"OMP_NUM_THREADS": "3"}, 2),
    ],
)
def test_explicit_threads(setting: int | None, environ: dict[str, str], expected: int | None) -> None:
    assert explicit_threads(setting, environ) == expected


def _allowed_cpus(pid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            cpus: set[int] = set()
            for part in line.split(":", 1)[1].strip().split(","):
                low, _, high = part.partition("-")
                cpus.update(range(int(low), int(high or low) + 1))
            return cpus
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def test_a_served_engine_runs_where_the_plan_says(start_tiny_server: Callable[..., ServerProcess]) -> None:
    layout = host_cpu_layout(None, "split")
    server = start_tiny_server("--cpu-bind", "split")
    response = server.http.post(
        "/v1/completions", json={"model": "tiny-chat", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    core = server.core_pid
    assert core is not None
    if layout.core_cpus is None:
        pytest.skip(f"this machine gives no layout to pin ({layout}); the table covers the plan")
    assert layout.server_cpus is not None
    assert _allowed_cpus(server.pid) == set(layout.server_cpus)
    assert _allowed_cpus(core) == set(layout.core_cpus)
    assert server.log_text().count("CPU layout: server on") == 1


def test_an_unbound_engine_is_not_pinned(start_tiny_server: Callable[..., ServerProcess]) -> None:
    server = start_tiny_server("--cpu-bind", "none")
    core = server.core_pid
    assert core is not None
    everything = _allowed_cpus(os.getpid())
    assert _allowed_cpus(server.pid) == everything
    assert _allowed_cpus(core) == everything
    assert "CPU layout" not in server.log_text()
