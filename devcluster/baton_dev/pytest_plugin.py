"""pytest fixtures for the local control plane (register with `pytest_plugins` in conftest.py).

- `dev_cluster` (session): started on first use, stopped at the end of the session; a
  `baton_dev.testing.DevCluster` with admin/restricted clients and kubectl/helm runners.
- `k8s_namespace`: a fresh namespace per test, deleted afterwards.
- `kubectl_path`, `helm_path`: the built binaries.
- `admin_kubeconfig`, `restricted_kubeconfig`: kubeconfig files (for the official clients, kopf).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from baton_dev.binaries import find_binaries
from baton_dev.cluster import start_cluster, stop_cluster
from baton_dev.spec import ClusterSpec
from baton_dev.testing import DevCluster

# Small back-off so restart behaviour is observable in seconds, not minutes.
TEST_CLUSTER = ClusterSpec(
    name="pytest",
    kwok_nodes=2,
    kwok_gpus=8,
    process_nodes=1,
    process_gpus=8,
    backoff_initial_s=1.0,
    backoff_max_s=8.0,
)


@pytest.fixture(scope="session")
def dev_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    directory = tmp_path_factory.mktemp("baton-cluster")
    state = start_cluster(TEST_CLUSTER, find_binaries(), directory=directory)
    cluster = DevCluster.attach(state)
    try:
        yield cluster
    finally:
        cluster.close()
        stop_cluster(state)


@pytest.fixture
def k8s_namespace(dev_cluster: DevCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    with dev_cluster.namespace(request.node.name) as name:
        yield name


@pytest.fixture(scope="session")
def kubectl_path(dev_cluster: DevCluster) -> Path:
    return dev_cluster.kubectl_path


@pytest.fixture(scope="session")
def helm_path(dev_cluster: DevCluster) -> Path:
    return dev_cluster.helm_path


@pytest.fixture(scope="session")
def admin_kubeconfig(dev_cluster: DevCluster) -> Path:
    return dev_cluster.state.admin_kubeconfig


@pytest.fixture(scope="session")
def restricted_kubeconfig(dev_cluster: DevCluster) -> Path:
    return dev_cluster.state.restricted_kubeconfig
