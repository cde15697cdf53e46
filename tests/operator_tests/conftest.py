"""Fixtures of the operator tests: a bare API server (etcd + kube-apiserver) with the CRD,
shared by the session; and, for modules that run the operator process (which watches every
namespace, so other modules' resources would be resumed, reconciled and counted), one of the
module's own with the chart's RBAC installed (`own_apiserver`, `own_kube`, `chart_installed`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from baton_operator import crd
from baton_operator.kube import Kube
from baton_support.apiserver import ApiServer, Rest, binary_dir
from baton_support.operator_process import install_chart, operator_kubeconfig
from tests.operator_tests.kube_helpers import api_server_or_skip, async_kube, create_namespace

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    with api_server_or_skip(tmp_path_factory.mktemp("apiserver")) as server:
        yield server


def admin_client(server: ApiServer) -> Any:
    import kubernetes

    cfg = kubernetes.client.Configuration()
    cfg.host = server.url
    cfg.ssl_ca_cert = str(server.ca_file)
    cfg.api_key = {"authorization": f"Bearer {server.token}"}
    return kubernetes.client.ApiClient(cfg)


def install_crd(client: Any) -> None:
    """Create the committed CRD and wait until it is Established (condition, with a deadline)."""
    import kubernetes

    ext = kubernetes.client.ApiextensionsV1Api(client)
    try:
        ext.create_custom_resource_definition(yaml.safe_load((REPO / crd.OUTPUT_PATHS[0]).read_text()))
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:  # already there, e.g. from a test's `helm install` (same file)
            raise
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = ext.read_custom_resource_definition(crd.crd()["metadata"]["name"])
        if any(c.type == "Established" and c.status == "True" for c in got.status.conditions or []):
            return
        time.sleep(0.1)
    raise TimeoutError("CRD not Established within 30 s")


@pytest.fixture
async def akube(apiserver: ApiServer) -> AsyncIterator[Kube]:
    """An asyncio client of the session's API server (the operator's own `Kube`)."""
    kube = async_kube(apiserver)
    yield kube
    await kube.close()


@pytest.fixture(scope="session")
def kube(apiserver: ApiServer) -> Iterator[Any]:
    """An admin client of a server that has the InferenceDeployment CRD."""
    client = admin_client(apiserver)
    install_crd(client)
    yield client
    client.close()


@pytest.fixture
def rest(apiserver: ApiServer) -> Rest:
    return Rest(apiserver)


_namespaces = itertools.count()


@pytest.fixture
def namespace(kube: Any) -> str:
    """A namespace of its own on the session's API server (which has the CRD)."""
    name = f"t{next(_namespaces)}"
    create_namespace(kube, name)
    return name


@pytest.fixture(scope="module")
def own_apiserver(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ApiServer]:
    module = request.module.__name__.rsplit(".", 1)[-1]
    with api_server_or_skip(tmp_path_factory.mktemp(f"{module}-apiserver")) as server:
        yield server


@pytest.fixture(scope="module")
def own_kube(own_apiserver: ApiServer) -> Iterator[Any]:
    """An admin client of `own_apiserver`, with the CRD installed."""
    client = admin_client(own_apiserver)
    install_crd(client)
    yield client
    client.close()


@pytest.fixture(scope="module")
def chart_installed(own_apiserver: ApiServer, own_kube: Any) -> tuple[Path, str]:
    """What `helm install` creates for the operator; (its kubeconfig, its token)."""
    helm = binary_dir()
    assert helm is not None
    rest = Rest(own_apiserver)
    sa = install_chart(rest, helm / "helm")
    return operator_kubeconfig(own_apiserver, rest, sa, own_apiserver.workdir / "operator.kubeconfig")
