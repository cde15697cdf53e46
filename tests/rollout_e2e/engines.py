"""Reading the engine pods of a deployment on the local control plane while they come and go:
their /metrics sampled by a thread (a pod's counters die with it), and their logs, which the
process node keeps after the pod is gone."""

from __future__ import annotations

import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from baton_dev.testing import DevCluster
from baton_engine import contract
from bench.cold_start import http_url


def counters(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter and gauge sample of a /metrics text by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def sample_sum(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return sum(
        v
        for (n, lab), v in samples.items()
        if n == name and all(dict(lab).get(k) == x for k, x in labels.items())
    )


class EngineSampler:
    """Polls every engine pod of a deployment about once a second and keeps each pod's latest
    /metrics: the counters of a pod that was drained and stopped since are its last reading."""

    def __init__(self, cluster: DevCluster, namespace: str, deployment: str, period_s: float = 1.0) -> None:
        self.cluster, self.namespace, self.deployment, self.period_s = (
            cluster,
            namespace,
            deployment,
            period_s,
        )
        self.latest: dict[
            str, dict[tuple[str, tuple[tuple[str, str], ...]], float]
        ] = {}  # pod name -> samples
        self.roles: dict[str, str] = {}  # pod name -> role
        self.keys: dict[str, str] = {}  # pod name -> KV-compatibility key
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-sampler", daemon=True)

    def __enter__(self) -> EngineSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        selector = f"{contract.LABEL_DEPLOYMENT}={self.deployment},{contract.LABEL_ENGINE}=true"
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while not self._stop.wait(self.period_s):
                try:
                    pods = self.cluster.pods(self.namespace, selector)
                except Exception:  # the API server briefly busy: the next round reads again
                    continue
                for pod in pods:
                    if not pod["status"].get("podIP") or pod["status"].get("phase") != "Running":
                        continue
                    name = pod["metadata"]["name"]
                    labels = pod["metadata"].get("labels") or {}
                    try:
                        text = client.get(http_url(pod, contract.PATH_METRICS)).text
                    except httpx.HTTPError:  # not listening yet, or stopped: its last reading stays
                        continue
                    with self._lock:
                        self.latest[name] = counters(text)
                        self.roles[name] = str(labels.get(contract.LABEL_ROLE))
                        self.keys[name] = str(labels.get(contract.LABEL_KV_COMPAT, ""))

    def total(self, name: str, **labels: str) -> dict[str, float]:
        """Pod name -> the metric's last reading on that pod (summed over other labels)."""
        with self._lock:
            return {pod: sample_sum(samples, name, **labels) for pod, samples in self.latest.items()}
