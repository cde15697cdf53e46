"""Helpers for tests against a running local cluster: a handle with admin and restricted clients,
kubectl/helm runners, namespaces, and condition waits with deadlines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from baton_dev.kubeapi import ApiAccess, ApiError, JsonObject, KubeApi
from baton_dev.node_agent.context import EVENTS_FILE
from baton_dev.state import ClusterState
from baton_support.wait import wait_for

T = TypeVar("T")


@dataclass
class DevCluster:
    """A running cluster as tests see it."""

    state: ClusterState
    admin: KubeApi
    restricted: KubeApi

    @staticmethod
    def attach(state: ClusterState) -> DevCluster:
        admin = KubeApi(ApiAccess.from_kubeconfig(state.admin_kubeconfig))
        restricted = KubeApi(ApiAccess.from_kubeconfig(state.restricted_kubeconfig))
        return DevCluster(state, admin, restricted)

    def close(self) -> None:
        self.admin.close()
        self.restricted.close()

    @property
    def kubectl_path(self) -> Path:
        return self.state.bin_dir / "kubectl"

    @property
    def helm_path(self) -> Path:
        return self.state.bin_dir / "helm"

    def _run(
        self, argv: list[str], kubeconfig: Path, stdin: str | None, check: bool
    ) -> subprocess.CompletedProcess[str]:
        env = dict(
            os.environ,
            KUBECONFIG=str(kubeconfig),
            HELM_CACHE_HOME=str(self.state.directory / "helm-cache"),
            HELM_CONFIG_HOME=str(self.state.directory / "helm-config"),
            HELM_DATA_HOME=str(self.state.directory / "helm-data"),
        )
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return result

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, restricted: bool = False
    ) -> subprocess.CompletedProcess[str]:
        kubeconfig = self.state.restricted_kubeconfig if restricted else self.state.admin_kubeconfig
        return self._run([str(self.kubectl_path), *args], kubeconfig, stdin, check)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run([str(self.helm_path), *args], self.state.admin_kubeconfig, None, check)

    # --- namespaces ----------------------------------------------------------------------------
    @contextmanager
    def namespace(self, hint: str, labels: dict[str, str] | None = None) -> Iterator[str]:
        """A fresh namespace (default ServiceAccount present), deleted afterwards."""
        slug = re.sub(r"[^a-z0-9-]+", "-", hint.lower()).strip("-")[:40].strip("-")
        name = f"{slug}-{uuid.uuid4().hex[:6]}"
        self.admin.post("/api/v1/namespaces", {"metadata": {"name": name, "labels": labels or {}}})
        try:
            wait_for(
                lambda: self.exists(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
                timeout=30,
                interval=0.1,
                message=f"the default ServiceAccount in {name}",
            )
            yield name
        finally:
            try:
                self.admin.delete(f"/api/v1/namespaces/{name}")
            except ApiError as e:
                if e.status != 404:
                    raise

    # --- objects -------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        try:
            self.admin.get(path)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    def pod(self, namespace: str, name: str) -> JsonObject:
        return self.admin.get(f"/api/v1/namespaces/{namespace}/pods/{name}")

    def pods(self, namespace: str, selector: str = "") -> list[JsonObject]:
        params: dict[str, Any] = {"labelSelector": selector} if selector else {}
        items: list[JsonObject] = self.admin.get(f"/api/v1/namespaces/{namespace}/pods", **params)["items"]
        return items

    def apply(self, manifest: JsonObject | str, namespace: str | None = None) -> None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        self.kubectl(*args, stdin=text)

    # --- the process-node agent's event log ----------------------------------------------------
    def agent_events(self, namespace: str, name: str, event: str | None = None) -> list[JsonObject]:
        """events.jsonl records for one pod (optionally one kind), oldest first."""
        path = self.state.agent_dir / EVENTS_FILE
        if not path.exists():
            return []
        key = f"{namespace}/{name}"
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in records if r.get("pod") == key and (event is None or r["event"] == event)]

    def pod_log(self, namespace: str, name: str, container: str) -> str:
        """The output of a process-node pod's container (all runs, appended)."""
        matches = sorted((self.state.agent_dir / "pods").glob(f"{namespace}_{name}_*/{container}.log"))
        return "".join(m.read_text(errors="replace") for m in matches)


def condition(obj: JsonObject, kind: str) -> JsonObject | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return None


def is_ready(pod: JsonObject) -> bool:
    c = condition(pod, "Ready")
    return c is not None and c.get("status") == "True"
