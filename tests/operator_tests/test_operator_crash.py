"""Crash consistency of the real operator process: killed just before its K+1-th child write,
then restarted; the children, their field owners and observedGeneration end up exact."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from baton_operator.kube import FIELD_MANAGER
from tests.operator_tests.apiserver import ApiServer, api_server, binary_dir
from tests.operator_tests.cases import VALID_SPEC
from tests.operator_tests.conftest import admin_client, install_crd
from tests.operator_tests.kube_helpers import Rest, create_infd, create_namespace, get_infd, wait_for
from tests.operator_tests.operator_process import install_chart, operator_kubeconfig, operator_process
from tests.operator_tests.test_reconcile_apiserver import EXPECTED, children, managers

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    bin_dir = binary_dir()
    if bin_dir is None:
        pytest.skip("etcd/kube-apiserver not built yet (bash devcluster/scripts/build.sh)")
    with api_server(tmp_path_factory.mktemp("crash-apiserver"), bin_dir) as server:
        yield server


@pytest.fixture(scope="module")
def kube(apiserver: ApiServer) -> Iterator[Any]:
    client = admin_client(apiserver)
    install_crd(client)
    yield client
    client.close()


@pytest.fixture(scope="module")
def kubeconfig(apiserver: ApiServer, kube: Any) -> Path:
    helm = binary_dir()
    assert helm is not None
    rest = Rest(apiserver)
    sa = install_chart(rest, helm / "helm")
    path, _ = operator_kubeconfig(apiserver, rest, sa, apiserver.workdir / "operator.kubeconfig")
    return path


@pytest.mark.parametrize("k", [7])  # the reconcile-level test covers more K
def test_killed_after_k_writes_then_restarted(
    apiserver: ApiServer, kube: Any, kubeconfig: Path, k: int
) -> None:
    rest = Rest(apiserver)
    namespace = f"crash-{k}"
    create_namespace(kube, namespace)
    env = {"CRASH_AFTER_WRITES": str(k)}
    with operator_process(
        kubeconfig,
        apiserver.workdir,
        "--no-peering",
        module="tests.operator_tests.crashing_operator",
        env_extra=env,
        namespace=namespace,  # other namespaces' resources would be resumed (and count) first
    ) as doomed:
        create_infd(kube, namespace, "demo", VALID_SPEC)
        assert wait_for(lambda: doomed.proc.poll() is not None, 60, "the operator to die") is not None
        assert doomed.proc.returncode == 137
        assert f"killed before write {k + 1}" in doomed.log_text()
    assert len(children(rest, namespace)) == k
    assert "observedGeneration" not in get_infd(kube, namespace, "demo").get("status", {})

    with operator_process(kubeconfig, apiserver.workdir, "--no-peering", namespace=namespace):
        wait_for(
            lambda: get_infd(kube, namespace, "demo").get("status", {}).get("observedGeneration") == 1,
            60,
            "the restarted operator to finish",
        )
    found = children(rest, namespace)
    assert set(found) == EXPECTED
    for (kind, _), obj in found.items():
        assert managers(obj) == {(FIELD_MANAGER, "Update" if kind == "Secret" else "Apply")}
    assert get_infd(kube, namespace, "demo")["metadata"].get("finalizers", []) == []
