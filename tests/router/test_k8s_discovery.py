"""Kubernetes discovery against the local control plane: Pods on kwok nodes (scheduled, marked
running and Ready, nothing runs) become router endpoints, and go away again."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from baton_dev.spec import KWOK_TOLERATION
from baton_dev.testing import DevCluster
from baton_engine import contract
from baton_engine.router.discovery import KubernetesDiscovery, selector_string
from baton_engine.router.endpoints import Endpoint, EndpointRegistry
from baton_support.wait import wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def _pod(name: str, role: str, deployment: str = "demo") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": contract.pod_selector(deployment, role)},
        "spec": {
            "nodeSelector": {"type": "kwok"},
            "tolerations": [KWOK_TOLERATION],
            "containers": [
                {
                    "name": "engine",
                    "image": "example.invalid/engine:1",
                    "ports": [
                        {"name": contract.PORT_HTTP, "containerPort": 8001},
                        {"name": contract.PORT_KV_EVENTS, "containerPort": 6001},
                    ],
                }
            ],
        },
    }


class DiscoveryThread:
    """Runs discovery on its own event loop; the test reads the events it produced."""

    def __init__(self, discovery: KubernetesDiscovery) -> None:
        self.events: list[tuple[str, Endpoint]] = []
        self._discovery = discovery
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        registry = EndpointRegistry()
        registry.subscribe(lambda kind, e: self.events.append((kind, e)))
        self._task = self._loop.create_task(self._discovery(registry))
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        finally:
            self._loop.close()

    def live(self, role: str) -> dict[str, Endpoint]:
        """Endpoints of ``role`` added and not removed since, by pod name."""
        current: dict[str, Endpoint] = {}
        for kind, endpoint in list(self.events):
            if endpoint.role != role:
                continue
            if kind == "added":
                current[endpoint.name] = endpoint
            elif current.get(endpoint.name) == endpoint:
                del current[endpoint.name]
        return current

    def __enter__(self) -> DiscoveryThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        wait_for(lambda: self._task is not None, message="discovery task")
        assert self._task is not None
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()


@pytest.fixture
def kubeconfig_env(dev_cluster: DevCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(dev_cluster.state.admin_kubeconfig))
    yield


def test_pods_become_endpoints_and_leave(dev_cluster: DevCluster, k8s_namespace: str, kubeconfig_env) -> None:
    dev_cluster.apply(_pod("demo-prefill-0", "prefill"), k8s_namespace)
    selectors = {role: selector_string(contract.pod_selector("demo", role)) for role in ("prefill", "decode")}
    with DiscoveryThread(KubernetesDiscovery(k8s_namespace, selectors)) as discovery:
        # present before the watch started (list) and created after it (watch)
        dev_cluster.apply(_pod("demo-decode-0", "decode"), k8s_namespace)
        dev_cluster.apply(_pod("other-prefill-0", "prefill", deployment="other"), k8s_namespace)
        wait_for(
            lambda: discovery.live("prefill") and discovery.live("decode"), timeout=60, message="both pods"
        )

        pods = {p["metadata"]["name"]: p for p in dev_cluster.pods(k8s_namespace)}
        for name, role in (("demo-prefill-0", "prefill"), ("demo-decode-0", "decode")):
            endpoint = discovery.live(role)[name]
            pod = pods[name]
            assert endpoint.url == f"http://{pod['status']['podIP']}:8001"
            assert endpoint.uid == pod["metadata"]["uid"]
            assert endpoint.port(contract.PORT_KV_EVENTS) == 6001
            assert endpoint.host.startswith("127.1.")
        assert list(discovery.live("prefill")) == ["demo-prefill-0"]  # the other deployment's pod is not ours

        dev_cluster.kubectl("delete", "pod", "demo-prefill-0", "-n", k8s_namespace, "--wait=false")
        wait_for(lambda: not discovery.live("prefill"), timeout=60, message="the deleted pod to leave")
        assert list(discovery.live("decode")) == ["demo-decode-0"]
