"""The Helm chart: lint-clean, schema-checked values, least-privilege RBAC, hardened Deployment."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from baton_support.apiserver import ApiServer, Rest, binary_dir
from baton_support.operator_process import CHART, helm_template


@pytest.fixture(scope="module")
def helm() -> Path:
    found = binary_dir()
    if found is None or not (found / "helm").is_file():
        pytest.skip("helm not built yet (bash devcluster/scripts/build.sh)")
    return found / "helm"


def lint(helm: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    args = [str(helm), "lint", "--strict", str(CHART), *(f"--set={s}" for s in sets)]
    return subprocess.run(args, capture_output=True, text=True)


def test_lint_is_clean(helm: Path) -> None:
    done = lint(helm)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("replicaCount=-1", "replicaCount"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("watchNamespaces[0]=Bad_Name", "watchNamespaces"),
        ("unknownKey=1", "unknownKey"),
    ],
)
def test_values_schema_refuses(helm: Path, value: str, message: str) -> None:
    done = lint(helm, value)
    assert done.returncode != 0
    assert message in done.stdout + done.stderr


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def test_cluster_role_never_reads_secrets(helm: Path) -> None:
    rules = by_kind(helm_template(helm), "ClusterRole")["rules"]
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    secret_rules = [r for r in rules if "secrets" in r["resources"]]
    assert secret_rules == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "patch"]}]
    verbs = {(g, res): r["verbs"] for r in rules for g in r["apiGroups"] for res in r["resources"]}
    assert verbs[("apps", "deployments")] == ["get", "list", "watch", "create", "patch"]
    assert verbs[("baton.dev", "inferencedeployments/status")] == ["get", "patch"]
    assert verbs[("", "pods")] == ["get", "list", "watch"]
    assert "delete" not in verbs[("apps", "deployments")]  # garbage collection deletes children


def test_operator_deployment(helm: Path) -> None:
    docs = helm_template(
        helm,
        "nodeSelector.pool=system",
        "tolerations[0].key=dedicated",
        "tolerations[0].operator=Exists",
        "watchNamespaces={llm,batch}",
        "monitoringNamespace=monitoring",
    )
    deployment = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 2
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "128Mi"},
        "limits": {"memory": "256Mi"},
    }
    assert pod["nodeSelector"] == {"pool": "system"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert container["command"] == ["baton-operator", "run"]
    assert container["args"] == [
        "--namespace=llm",
        "--namespace=batch",
        "--bind=$(POD_IP)",
        "--metrics-port=8090",
        "--health-port=8081",
        "--resync-seconds=60",
        "--peering=baton-operator",
        "--monitoring-namespace=monitoring",
    ]
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert pod_ip in container["env"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    # The engines' NetworkPolicy admits operator pods by these two labels.
    assert (labels["app.kubernetes.io/part-of"], labels["app.kubernetes.io/component"]) == (
        "baton",
        "operator",
    )
    peerings = [d for d in docs if d["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["batch", "llm"]


def test_crds_are_kept_on_uninstall() -> None:
    names = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert names == ["inferencedeployments.baton.dev.yaml", "kopf-peerings.yaml"]
    assert not list((CHART / "templates").glob("*crd*"))


@pytest.mark.k8s
def test_helm_install_and_uninstall_keeps_the_crds(helm: Path, apiserver: ApiServer) -> None:
    kubeconfig = apiserver.kubeconfig()
    base = [str(helm), "--kubeconfig", str(kubeconfig), "-n", "baton-helm"]
    install = subprocess.run(
        [*base, "install", "baton", str(CHART), "--create-namespace", "--set", "replicaCount=1"],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    assert "Baton's operator is installed in namespace baton-helm" in install.stdout  # NOTES.txt
    rest = Rest(apiserver)
    assert rest.get("/apis/apps/v1/namespaces/baton-helm/deployments/baton-operator")["spec"]["replicas"] == 1
    assert rest.call("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles/baton-operator")[0] == 200
    uninstall = subprocess.run([*base, "uninstall", "baton", "--wait"], capture_output=True, text=True)
    assert uninstall.returncode == 0, uninstall.stderr
    assert rest.call("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles/baton-operator")[0] == 404
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    for name in ("inferencedeployments.baton.dev", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"):
        assert rest.call("GET", f"{crds}/{name}")[0] == 200, name


NAMESPACE_ONLY_IN_CLUSTER_ROLE = (["customresourcedefinitions"], ["namespaces"], ["clusterkopfpeerings"])


def test_watched_namespaces_get_roles_and_the_cluster_role_keeps_only_crds(helm: Path) -> None:
    docs = helm_template(helm, "watchNamespaces={llm,batch}")
    crds = {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["get", "list", "watch"],
    }
    assert by_kind(docs, "ClusterRole")["rules"] == [crds]
    everywhere = by_kind(helm_template(helm), "ClusterRole")["rules"]
    namespaced = [r for r in everywhere if r["resources"] not in NAMESPACE_ONLY_IN_CLUSTER_ROLE]
    peering = {
        "apiGroups": ["kopf.dev"],
        "resources": ["kopfpeerings"],
        "verbs": ["get", "list", "watch", "patch"],
    }
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role"}
    assert sorted(roles) == ["batch", "llm"]
    for role in roles.values():
        assert role["rules"] == [*namespaced, peering]
    bindings = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "RoleBinding"}
    assert sorted(bindings) == ["batch", "llm"]
    for binding in bindings.values():
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "baton-operator",
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "baton-operator", "namespace": "baton-system"}
        ]
    # Cluster-wide, the ClusterRole holds everything and there are no Roles.
    assert [d for d in helm_template(helm) if d["kind"] in ("Role", "RoleBinding")] == []
    assert crds in everywhere and len(everywhere) == len(namespaced) + 3
