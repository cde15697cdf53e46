"""Engine pods without engines, for autoscaler tests on a real API server: Pod objects whose
status the test writes (no kubelet) pointing at HTTP servers that answer /metrics with the load
the test sets."""

from __future__ import annotations

from typing import Any

from baton_engine import contract
from baton_operator.kube import collection_path
from baton_support.apiserver import Rest
from baton_support.metrics_servers import MetricsServer, answer


def autoscaled_spec(scale_down_window_s: int) -> dict[str, Any]:
    """A builtin-autoscaled resource deciding every second: prefill 1..3 on a queue target of 2,
    decode 1..2 on a KV target of 0.5, up at once by 2, down by 1 per window."""
    return {
        "model": {"name": "smollm2", "source": "builtin:smollm2-135m-instruct"},
        "autoscaling": {
            "mode": "builtin",
            "intervalSeconds": 1,
            "prefill": {"minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 2},
            "decode": {"minReplicas": 1, "maxReplicas": 2, "targetKVUsage": 0.5},
            "scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 2},
            "scaleDown": {"stabilizationWindowSeconds": scale_down_window_s, "maxStep": 1},
        },
    }


class Load:
    """One engine's /metrics, settable by the test."""

    def __init__(self) -> None:
        self.waiting, self.kv = 0, 0.1
        self.server = MetricsServer(self._answer)

    def _answer(self, server: MetricsServer, handler: Any) -> None:
        text = (
            f'{contract.M_REQUESTS_WAITING}{{model_name="smollm2"}} {self.waiting}\n'
            f'{contract.M_REQUESTS_RUNNING}{{model_name="smollm2"}} 0\n'
            f'{contract.M_KV_USAGE}{{model_name="smollm2"}} {self.kv}\n'
        )
        answer(200, text)(server, handler)

    @property
    def port(self) -> int:
        return int(self.server.httpd.server_address[1])


def deployment_path(namespace: str, name: str) -> str:
    return collection_path("apps/v1", "Deployment", namespace) + f"/{name}"


def replicas(rest: Rest, namespace: str, name: str) -> int:
    return int(rest.get(deployment_path(namespace, name))["spec"]["replicas"])


def add_ready_pod(rest: Rest, namespace: str, deployment: str, role: str, port: int) -> None:
    """A Running, Ready engine pod as a kubelet would report it, serving /metrics on `port`."""
    name = f"{deployment}-{role}-0"
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": contract.pod_selector(deployment, role),
        },
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "image": "baton",
                    "ports": [{"name": contract.PORT_HTTP, "containerPort": port}],
                }
            ]
        },
    }
    status, body = rest.call("POST", collection_path("v1", "Pod", namespace), pod)
    assert status == 201, body
    ready = {
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}],
        }
    }
    path = collection_path("v1", "Pod", namespace) + f"/{name}/status"
    status, body = rest.call("PATCH", path, ready, "application/merge-patch+json")
    assert status == 200, body
