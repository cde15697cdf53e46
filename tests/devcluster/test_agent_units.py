"""Pure parts of the node agent and harness (no cluster needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton_dev.node_agent.env import ConfigError, expand, field_value, resource_value
from baton_dev.node_agent.node import PodIpPool
from baton_dev.node_agent.pod_range import FIRST_OCTET, LAST_OCTET, claim_pod_range
from baton_dev.processes import ProcessRecord, is_alive, spawn, stop
from baton_dev.spec import ClusterSpec


def test_dollar_expansion_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B.c": "2"}
    assert expand("$(A)-$(B.c)-$$(A)-$(MISSING)-$A", env) == "1-2-$(A)-$(MISSING)-$A"


def test_field_refs() -> None:
    pod = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"role": "decode"}},
        "spec": {"nodeName": "process-node-0"},
    }
    assert field_value(pod, "metadata.labels['role']", "127.2.0.9", "127.0.0.1") == "decode"
    assert field_value(pod, "spec.serviceAccountName", "127.2.0.9", "127.0.0.1") == "default"
    assert field_value(pod, "status.hostIP", "127.2.0.9", "127.0.0.1") == "127.0.0.1"
    with pytest.raises(ConfigError, match="fieldRef 'spec.hostname' is not supported"):
        field_value(pod, "spec.hostname", "127.2.0.9", "127.0.0.1")


def test_resource_field_ref_like_the_kubelet() -> None:
    container = {"resources": {"limits": {"cpu": "1500m", "amd.com/gpu": "2"}, "requests": {"memory": "1Gi"}}}
    allocatable = {"memory": "256Gi"}
    assert resource_value(container, {"resource": "limits.cpu"}) == "2"
    assert resource_value(container, {"resource": "limits.cpu", "divisor": "1m"}) == "1500"
    assert resource_value(container, {"resource": "limits.amd.com/gpu"}) == "2"
    assert resource_value(container, {"resource": "requests.memory", "divisor": "1Mi"}) == "1024"
    # No memory limit: the node's allocatable memory.
    assert resource_value(container, {"resource": "limits.memory", "divisor": "1Gi"}, allocatable) == "256"
    assert resource_value(container, {"resource": "requests.cpu"}) == "0"


def test_pod_ip_pool_is_round_robin_and_bounded() -> None:
    pool = PodIpPool("127.2.3.0/30")  # two usable hosts
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == ("127.2.3.1", "127.2.3.2")
    with pytest.raises(RuntimeError, match="pod CIDR exhausted"):
        pool.allocate()
    pool.release(a)
    assert pool.allocate() == "127.2.3.1"


def test_cluster_spec_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="kwok_nodes=-1: must be between 0 and 250"):
        ClusterSpec(kwok_nodes=-1)
    with pytest.raises(ValueError, match="cluster name 'a b'"):
        ClusterSpec(name="a b")


def test_stop_never_signals_a_reused_pid(tmp_path: Path) -> None:
    record = spawn("sleeper", ["sleep", "30"], log=tmp_path / "s.log")
    impostor = ProcessRecord(name="x", pid=record.pid, start_ticks=record.start_ticks + 1, log="")
    assert not is_alive(impostor)
    assert stop(impostor) is False
    assert is_alive(record)
    assert stop(record) is True
    assert not is_alive(record)


def test_two_clusters_claim_disjoint_pod_ranges(tmp_path: Path) -> None:
    with claim_pod_range(tmp_path) as first, claim_pod_range(tmp_path) as second:
        assert (first.octet, second.octet) == (FIRST_OCTET, FIRST_OCTET + 1)
        assert not first.network.overlaps(second.network)
        assert (first.node_cidr(0), second.node_cidr(0)) == ("127.3.0.0/24", "127.4.0.0/24")
        assert second.node_cidr(249) == "127.4.249.0/24"
        with pytest.raises(ValueError, match="process node index 256: must be between 0 and 255"):
            second.node_cidr(256)
        first.close()  # that cluster stopped: the next one started gets its range
        with claim_pod_range(tmp_path) as third:
            assert third.octet == FIRST_OCTET


def test_every_pod_range_held_is_a_clear_error(tmp_path: Path) -> None:
    held = [claim_pod_range(tmp_path) for _ in range(FIRST_OCTET, LAST_OCTET + 1)]
    try:
        assert [r.octet for r in held] == list(range(3, 255))
        with pytest.raises(RuntimeError, match=r"no free pod IP range: 127\.3-254\.0\.0/16 are all held"):
            claim_pod_range(tmp_path)
    finally:
        for pod_range in held:
            pod_range.close()
