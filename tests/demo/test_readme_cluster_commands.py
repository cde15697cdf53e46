"""The "install the operator" commands of docs/deploy.md, verbatim, against a real API server (etcd +
kube-apiserver, no nodes: pods stay Pending, nothing needs a GPU), then every example applied
with kubectl exactly as a user would."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from baton_support.apiserver import ApiServer, binary_dir
from tests.demo.readme import REPO, block_after
from tests.operator_tests.kube_helpers import api_server_or_skip

pytestmark = pytest.mark.k8s

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
DEPLOY = REPO / "docs" / "deploy.md"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    with api_server_or_skip(tmp_path_factory.mktemp("readme-apiserver")) as started:
        yield started


def shell(command: str, server: ApiServer, home: Path) -> subprocess.CompletedProcess[str]:
    bin_dir = binary_dir()
    assert bin_dir is not None
    env = dict(
        os.environ,
        KUBECONFIG=str(server.kubeconfig()),
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        HELM_CACHE_HOME=str(home / "cache"),
        HELM_CONFIG_HOME=str(home / "config"),
        HELM_DATA_HOME=str(home / "data"),
    )
    return subprocess.run(
        ["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )


def test_readme_real_cluster_commands(server: ApiServer, tmp_path: Path) -> None:
    commands = block_after("## Install the operator and apply a resource", page=DEPLOY)
    assert commands == [
        "helm install baton charts/baton -n baton-system --create-namespace",
        "kubectl apply -f examples/minimal.yaml",
        "kubectl get infd",
    ]
    results = [shell(c, server, tmp_path) for c in commands]
    for command, result in zip(commands, results, strict=True):
        assert result.returncode == 0, f"{command}: {result.stderr}"
    assert "STATUS: deployed" in results[0].stdout
    assert results[1].stdout.strip() == "inferencedeployment.baton.dev/smollm2 created"
    header, row = results[2].stdout.strip().splitlines()
    assert header.split() == ["NAME", "MODEL", "MODE", "PREFILL", "DECODE", "READY", "AGE"]
    assert row.split()[:3] == ["smollm2", "smollm2", "disaggregated"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_applies_with_kubectl(server: ApiServer, tmp_path: Path, path: Path) -> None:
    crds = shell("kubectl apply --server-side -f charts/baton/crds/", server, tmp_path)
    assert crds.returncode == 0, crds.stderr
    established = shell(
        "kubectl wait --for=condition=Established --timeout=60s crd/inferencedeployments.baton.dev",
        server,
        tmp_path,
    )
    assert established.returncode == 0, established.stderr
    namespace = f"example-{path.stem}"
    assert shell(f"kubectl create namespace {namespace}", server, tmp_path).returncode == 0
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    applied = shell(f"kubectl apply -n {namespace} -f examples/{path.name}", server, tmp_path)
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.strip() == f"inferencedeployment.baton.dev/{name} created"
    listed = shell(f"kubectl get infd -n {namespace} -o name", server, tmp_path)
    assert listed.stdout.strip() == f"inferencedeployment.baton.dev/{name}"
