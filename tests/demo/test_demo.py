"""`make demo` as CI runs it (DEMO_NONINTERACTIVE=1) on a cluster of its own (a private
BATON_DEV_HOME), then `make demo-down`: the answer is text, the resource is Ready, and no process
the demo started (control plane, node agent, pod processes) is left, checked by pid."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from baton_dev.cluster import leftover_pod_processes
from baton_dev.processes import ProcessRecord, is_alive, start_ticks
from baton_dev.state import ClusterState
from tests.demo.readme import block_after

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.model]

REPO = Path(__file__).resolve().parents[2]


def make(target: str, home: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, BATON_DEV_HOME=str(home), DEMO_NONINTERACTIVE="1")
    return subprocess.run(
        ["make", "--no-print-directory", target],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.fixture
def demo_home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "clusters"
    try:
        yield home
    finally:  # whatever happened above, nothing keeps running
        make("demo-down", home, 120)


def all_processes(state: ClusterState) -> list[ProcessRecord]:
    """Every recorded process and, for each, its live descendants (e.g. an engine's core process)."""
    records = [*state.processes, *leftover_pod_processes(state)]
    parents = _parent_pids()
    seen = {r.pid for r in records}
    frontier = list(seen)
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in seen:
                seen.add(child)
                frontier.append(child)
                ticks = start_ticks(child)
                if ticks is not None:
                    records.append(ProcessRecord(name=f"child-{child}", pid=child, start_ticks=ticks, log=""))
    return records


def _parent_pids() -> dict[int, int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return parents


def test_make_demo_then_demo_down(demo_home: Path) -> None:
    up = make("demo", demo_home, 1500)
    assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
    for step in range(1, 8):
        assert f"[{step}/7] " in up.stdout
    assert "make demo-down" in up.stdout

    cluster = demo_home / "demo"
    result = json.loads((cluster / "demo.json").read_text())
    assert isinstance(result["answer"], str) and result["answer"].strip()
    assert f"A: {result['answer'].strip()}" in up.stdout

    curl = up.stdout[up.stdout.index("curl -s ") :].split("\n  logs:")[0]
    asked = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=300)
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["choices"][0]["message"]["content"].strip()

    state = ClusterState.load(cluster)
    # The README's "talk to the running demo" lines, verbatim, minus the final `make demo-down`;
    # docs/getting-started.md shows the same lines.
    talk = block_after("## A five-minute tour")
    assert block_after("## Talk to the running demo", page=REPO / "docs/getting-started.md") == talk
    assert talk[-1] == "make demo-down"
    shell = subprocess.run(
        ["bash", "-c", " && ".join(talk[:-1])],
        cwd=REPO,
        env=dict(os.environ, BATON_DEV_HOME=str(demo_home)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shell.returncode == 0, shell.stderr
    header, row = shell.stdout.strip().splitlines()
    assert header.split() == ["NAME", "MODEL", "MODE", "PREFILL", "DECODE", "READY", "AGE"]
    name, model, mode, prefill, decode, ready, _age = row.split()
    assert (name, model, mode, prefill, decode, ready) == (
        "smollm2-pd", "smollm2", "disaggregated", "1/1", "1/1", "True",
    )  # fmt: skip

    started = all_processes(state)
    names = {p.name for p in state.processes}
    assert {"etcd", "kube-apiserver", "node-agent"} <= names
    pod_processes = leftover_pod_processes(state)
    assert len(pod_processes) >= 4  # operator, prefill, decode, router
    assert all(is_alive(p) for p in started)
    assert len(started) > len(state.processes) + len(pod_processes)  # the engines' core processes

    down = make("demo-down", demo_home, 180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped" in down.stdout
    assert [p for p in started if is_alive(p)] == []
