"""The chart with `watchNamespaces` on a real API server: the operator's ServiceAccount gets a Role
in each watched namespace (and a ClusterRole for CRDs only), `baton-operator run --namespace`
reconciles a resource there, and nothing outside: it cannot list pods or Secrets elsewhere, and a
resource in another namespace is never touched."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from baton_operator.kube import collection_path
from baton_support.apiserver import ApiServer, Rest, binary_dir
from baton_support.operator_process import (
    OperatorProcess,
    install_chart,
    operator_kubeconfig,
    operator_process,
)
from baton_support.wait import wait_for
from tests.operator_tests.cases import VALID_SPEC
from tests.operator_tests.kube_helpers import create_infd, create_namespace, get_infd

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

WATCHED, OTHER = "llm", "elsewhere"


@pytest.fixture(scope="module")
def namespaced_chart(own_apiserver: ApiServer, own_kube: Any) -> tuple[Path, str]:
    helm = binary_dir()
    assert helm is not None
    rest = Rest(own_apiserver)
    sa = install_chart(rest, helm / "helm", f"watchNamespaces={{{WATCHED}}}")
    return operator_kubeconfig(own_apiserver, rest, sa, own_apiserver.workdir / "namespaced.kubeconfig")


@pytest.fixture(scope="module")
def operator(own_apiserver: ApiServer, namespaced_chart: tuple[Path, str]) -> Iterator[OperatorProcess]:
    kubeconfig, _ = namespaced_chart
    with operator_process(kubeconfig, own_apiserver.workdir, "--resync-seconds=1", namespace=WATCHED) as proc:
        yield proc


def test_the_operator_reconciles_its_namespace_only(
    own_apiserver: ApiServer, own_kube: Any, namespaced_chart: tuple[Path, str], operator: OperatorProcess
) -> None:
    _, token = namespaced_chart
    create_namespace(own_kube, OTHER)
    create_infd(own_kube, OTHER, "ignored", VALID_SPEC)
    create_infd(own_kube, WATCHED, "demo", VALID_SPEC)
    wait_for(
        lambda: get_infd(own_kube, WATCHED, "demo").get("status", {}).get("observedGeneration") == 1,
        timeout=60,
        interval=0.1,
        message="the watched namespace's resource reconciled",
    )
    rest = Rest(own_apiserver)
    deployments = rest.get(collection_path("apps/v1", "Deployment", WATCHED))["items"]
    assert sorted(d["metadata"]["name"] for d in deployments) == [
        "demo-decode",
        "demo-prefill",
        "demo-router",
    ]
    # Periodic reconciles of the watched resource run, and the other namespace's is never touched.
    wait_for(
        lambda: _timer_reconciles(operator) >= 3,
        timeout=60,
        interval=0.1,
        message="three periodic reconciles",
    )
    assert "status" not in get_infd(own_kube, OTHER, "ignored")
    assert rest.get(collection_path("apps/v1", "Deployment", OTHER))["items"] == []

    as_operator = Rest(own_apiserver, token)
    sa = "system:serviceaccount:baton-system:baton-operator"
    for path, verb in (
        (collection_path("v1", "Pod", OTHER), "list"),
        ("/api/v1/pods", "list"),
        (collection_path("apps/v1", "Deployment", OTHER), "list"),
        (collection_path("v1", "Secret", WATCHED), "list"),
    ):
        status, body = as_operator.call("GET", path)
        assert status == 403, (path, body)
        assert f'User "{sa}" cannot {verb} resource' in body["message"], body["message"]
    status, body = as_operator.call("GET", collection_path("v1", "Pod", WATCHED))
    assert status == 200, body


def _timer_reconciles(operator: OperatorProcess) -> float:
    for line in operator.metrics().splitlines():
        if line.startswith('baton_operator_reconciles_total{result="ok",trigger="timer"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
