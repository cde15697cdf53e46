"""Crash consistency of the real operator process: killed just before its K+1-th child write,
then restarted; the children, their field owners and observedGeneration end up exact."""

from __future__ import annotations

from typing import Any

import pytest

from baton_operator.kube import FIELD_MANAGER
from baton_support.apiserver import ApiServer, Rest
from baton_support.operator_process import operator_process
from baton_support.wait import wait_for
from tests.operator_tests.cases import VALID_SPEC
from tests.operator_tests.kube_helpers import create_infd, create_namespace, get_infd
from tests.operator_tests.test_reconcile_apiserver import EXPECTED, children, managers

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


@pytest.mark.parametrize("k", [7])  # the reconcile-level test covers more K
def test_killed_after_k_writes_then_restarted(
    own_apiserver: ApiServer, own_kube: Any, chart_installed: Any, k: int
) -> None:
    kubeconfig, _ = chart_installed
    rest = Rest(own_apiserver)
    namespace = f"crash-{k}"
    create_namespace(own_kube, namespace)
    env = {"CRASH_AFTER_WRITES": str(k)}
    with operator_process(
        kubeconfig,
        own_apiserver.workdir,
        "--no-peering",
        module="tests.operator_tests.crashing_operator",
        env_extra=env,
        namespace=namespace,  # other namespaces' resources would be resumed (and count) first
    ) as doomed:
        create_infd(own_kube, namespace, "demo", VALID_SPEC)
        assert (
            wait_for(
                lambda: doomed.proc.poll() is not None,
                timeout=60,
                interval=0.1,
                message="the operator to die",
            )
            is not None
        )
        assert doomed.proc.returncode == 137
        assert f"killed before write {k + 1}" in doomed.log_text()
    assert len(children(rest, namespace)) == k
    assert "observedGeneration" not in get_infd(own_kube, namespace, "demo").get("status", {})

    with operator_process(kubeconfig, own_apiserver.workdir, "--no-peering", namespace=namespace):
        wait_for(
            lambda: get_infd(own_kube, namespace, "demo").get("status", {}).get("observedGeneration") == 1,
            timeout=60,
            interval=0.1,
            message="the restarted operator to finish",
        )
    found = children(rest, namespace)
    assert set(found) == EXPECTED
    for (kind, _), obj in found.items():
        assert managers(obj) == {(FIELD_MANAGER, "Update" if kind == "Secret" else "Apply")}
    assert get_infd(own_kube, namespace, "demo")["metadata"].get("finalizers", []) == []
