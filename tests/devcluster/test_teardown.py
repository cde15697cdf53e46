"""Stopping a cluster leaves no process behind: every component and every pod process, by pid."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton_dev.binaries import find_binaries
from baton_dev.cluster import leftover_pod_processes, start_cluster, stop_cluster
from baton_dev.processes import ProcessRecord, is_alive
from baton_dev.spec import ClusterSpec
from baton_dev.testing import DevCluster
from baton_support.wait import wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
SERVER = str(Path(__file__).parent / "data" / "podserver.py")


def test_down_stops_every_process(tmp_path: Path) -> None:
    spec = ClusterSpec(name="teardown", kwok_nodes=1, process_nodes=1)
    state = start_cluster(spec, find_binaries(), directory=tmp_path / "cluster")
    try:
        cluster = DevCluster.attach(state)
        for name, ignore_term in (("a", "0"), ("b", "1")):
            cluster.admin.post(
                "/api/v1/namespaces/default/pods",
                {
                    "metadata": {"name": name},
                    "spec": {
                        "nodeSelector": {"type": "process"},
                        "terminationGracePeriodSeconds": 60,
                        "containers": [
                            {
                                "name": "server",
                                "image": "x",
                                "command": ["python", SERVER],
                                "env": [
                                    {
                                        "name": "POD_IP",
                                        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                                    },
                                    {"name": "IGNORE_SIGTERM", "value": ignore_term},
                                ],
                            }
                        ],
                    },
                },
            )

        def both_running() -> list[ProcessRecord] | None:
            records = leftover_pod_processes(state)
            return records if len(records) == 2 else None

        pod_processes = wait_for(both_running, timeout=30, interval=0.1, message="both pod processes")
        cluster.close()
    finally:
        stopped = stop_cluster(state)
    components = [p for p in state.processes]
    assert sorted(p.name for p in components) == sorted(
        ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "node-agent"]
    )
    assert set(stopped) >= {p.name for p in components}
    assert [p.pid for p in components + pod_processes if is_alive(p)] == []
    assert all(not Path(f"/proc/{p.pid}").exists() or not is_alive(p) for p in pod_processes)
    assert leftover_pod_processes(state) == []
