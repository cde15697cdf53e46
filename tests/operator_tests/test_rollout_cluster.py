"""KV-compatibility key rollouts on the full local control plane (controller manager, scheduler)
with the operator as a process and the pools' pods on kwok nodes (scheduled and marked Ready;
nothing runs): what the Deployment and ReplicaSet controllers do with the operator's steps.

Every pod and ReplicaSet change is recorded by a watch, and the invariants are checked on every
state the API server went through: decode first, each pool within one pod of its spec count,
no generation with prefill pods but no decode pods, the Deployments' names and UIDs kept, the
old generation's ReplicaSets gone at the end. Real engines and traffic: tests/rollout_e2e.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from baton_dev import spec as cluster_spec
from baton_dev.kubeapi import ApiAccess
from baton_dev.testing import DevCluster, condition, is_ready, wait_for
from baton_engine import contract
from baton_operator import models
from baton_operator.rollout.generations import LABEL_RETIRING
from baton_support.operator_process import OperatorProcess, cluster_operator
from tests.operator_tests.timeline import (
    Timeline,
    key_of,
    key_of_pod,
    role_of,
    rollout_invariants,
    rollout_settled,
)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

KWOK = {cluster_spec.NODE_TYPE_LABEL: "kwok"}
ON_KWOK = {"nodeSelector": KWOK, "tolerations": [cluster_spec.KWOK_TOLERATION]}  # kwok nodes are tainted
CPU_POD = {"gpus": 0, "cpu": "100m", "memory": "256Mi"}


def spec(prefill: int, decode: int, mode: str = "off", **engine: Any) -> dict[str, Any]:
    return {
        "model": {"name": "smollm2", "source": "builtin:smollm2-135m-instruct"},
        "engine": {"device": "cpu", "dtype": "float32", **engine},
        "prefill": {"replicas": prefill, "resources": CPU_POD, **ON_KWOK},
        "decode": {"replicas": decode, "resources": CPU_POD, **ON_KWOK},
        "router": ON_KWOK,
        "kvEvents": {"enabled": False},
        "autoscaling": {
            "mode": mode,
            "prefill": {"minReplicas": 1, "maxReplicas": 4},
            "decode": {"minReplicas": 1, "maxReplicas": 4},
        },
    }


@pytest.fixture(scope="module")
def operator(dev_cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with cluster_operator(dev_cluster, tmp_path_factory.mktemp("operator"), "--no-peering") as proc:
        yield proc


class Resource:
    def __init__(self, cluster: DevCluster, namespace: str, name: str) -> None:
        self.cluster, self.ns, self.name = cluster, namespace, name
        self.path = f"/apis/{models.API_VERSION}/namespaces/{namespace}/{models.PLURAL}/{name}"

    def create(self, body: dict[str, Any]) -> None:
        doc = {
            "apiVersion": models.API_VERSION,
            "kind": models.KIND,
            "metadata": {"name": self.name},
            "spec": body,
        }
        self.cluster.apply(doc, self.ns)

    def patch(self, body: dict[str, Any]) -> None:
        self.cluster.admin.patch(self.path, {"spec": body})

    def get(self) -> dict[str, Any]:
        return self.cluster.admin.get(self.path)

    def pods(self, role: str) -> list[dict[str, Any]]:
        return self.cluster.pods(
            self.ns, f"{contract.LABEL_DEPLOYMENT}={self.name},{contract.LABEL_ROLE}={role}"
        )

    def deployment(self, role: str) -> dict[str, Any]:
        return self.cluster.admin.get(f"/apis/apps/v1/namespaces/{self.ns}/deployments/{self.name}-{role}")

    def replica_sets(self) -> list[dict[str, Any]]:
        path = f"/apis/apps/v1/namespaces/{self.ns}/replicasets"
        items: list[dict[str, Any]] = self.cluster.admin.get(
            path, labelSelector=f"{contract.LABEL_DEPLOYMENT}={self.name}"
        )["items"]
        return items

    def events(self, reason: str) -> list[str]:
        items = self.cluster.admin.get(f"/api/v1/namespaces/{self.ns}/events")["items"]
        return [
            e["message"] for e in items if e["reason"] == reason and e["involvedObject"]["name"] == self.name
        ]

    def settled(self, key: str, counts: dict[str, int]) -> bool:
        return rollout_settled(self.cluster, self.ns, self.name, key, counts)

    def wait_settled(self, key: str, counts: dict[str, int], what: str, timeout: float = 120) -> None:
        wait_for(lambda: self.settled(key, counts), timeout=timeout, interval=0.5, message=what)


def test_key_change_rolls_decode_first_in_two_generations_then_a_plain_change_rolls_in_place(
    dev_cluster: DevCluster, k8s_namespace: str, operator: OperatorProcess
) -> None:
    res = Resource(dev_cluster, k8s_namespace, "roll")
    body = spec(1, 2)
    res.create(body)
    old_key, counts = key_of(body), {"prefill": 1, "decode": 2}
    res.wait_settled(old_key, counts, "the pools Ready")
    uids = {role: res.deployment(role)["metadata"]["uid"] for role in counts}
    access = ApiAccess.from_kubeconfig(dev_cluster.state.admin_kubeconfig)
    pods_path = f"/api/v1/namespaces/{k8s_namespace}/pods"
    rs_path = f"/apis/apps/v1/namespaces/{k8s_namespace}/replicasets"

    changed = copy.deepcopy(body)
    changed["engine"]["blockSize"] = 32
    new_key = key_of(changed)
    assert new_key != old_key
    with Timeline(access, pods_path) as pods, Timeline(access, rs_path) as replica_sets:
        res.patch({"engine": {"blockSize": 32}})
        res.wait_settled(new_key, counts, "the new generation alone", timeout=180)
    states = rollout_invariants(pods, counts, new_key)
    assert states >= 10  # every pod of both generations went through several states
    released = {
        rs["metadata"]["name"]
        for rs in replica_sets.ever()
        if (rs["metadata"].get("labels") or {}).get(LABEL_RETIRING)
    }
    assert len(released) == 2  # one old ReplicaSet per pool, released and gone
    assert {role: res.deployment(role)["metadata"]["uid"] for role in counts} == uids
    for role in counts:
        template = res.deployment(role)["spec"]["template"]
        assert template["metadata"]["labels"][contract.LABEL_KV_COMPAT] == new_key
        assert "paused" not in res.deployment(role)["spec"]
    status = res.get()["status"]
    for role in counts:
        assert (status[role]["kvCompatKey"], status[role]["newKeyPods"], status[role]["oldKeyPods"]) == (
            new_key,
            counts[role],
            0,
        )
    wait_for(lambda: res.events("RolloutComplete"), timeout=30, message="the rollout's Events")
    [started] = res.events("RollingOut")
    assert started.startswith(f"KV-compatibility key {old_key} -> {new_key}: releasing the old generation")

    # A plain change (an env var): each pool rolls in place, no generation is released.
    with Timeline(access, rs_path) as replica_sets, Timeline(access, pods_path) as pods:
        res.patch({"engine": {"env": [{"name": "PLAIN_CHANGE", "value": "1"}]}})

        def rolled() -> bool:
            for role in counts:
                d = res.deployment(role)
                env = d["spec"]["template"]["spec"]["containers"][0]["env"]
                st = d.get("status", {})
                if not any(e["name"] == "PLAIN_CHANGE" for e in env):
                    return False
                if st.get("updatedReplicas") != counts[role] or st.get("replicas") != counts[role]:
                    return False
            return res.settled(new_key, counts)

        wait_for(rolled, timeout=180, interval=0.5, message="the plain change rolled out")
    assert not [rs for rs in replica_sets.ever() if LABEL_RETIRING in (rs["metadata"].get("labels") or {})]
    assert {key_of_pod(p) for p in pods.ever() if role_of(p) in counts} == {new_key}
    assert len(res.events("RollingOut")) == 1


def _released(res: Resource) -> list[dict[str, Any]]:
    return [rs for rs in res.replica_sets() if LABEL_RETIRING in (rs["metadata"].get("labels") or {})]


def test_builtin_mode_keeps_the_autoscalers_replicas_through_a_rollout(
    dev_cluster: DevCluster, k8s_namespace: str, operator: OperatorProcess
) -> None:
    """The autoscaler's count in force (decode 2, written under its field manager) is the
    rollout's target; the new generation's replicas are written under the autoscaler's field
    manager, which still alone owns them afterwards."""
    res = Resource(dev_cluster, k8s_namespace, "auto")
    body = spec(1, 1, mode="builtin")
    res.create(body)
    res.wait_settled(key_of(body), {"prefill": 1, "decode": 1}, "the pools Ready")
    path = f"/apis/apps/v1/namespaces/{k8s_namespace}/deployments/auto-decode"
    claim = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "auto-decode"},
        "spec": {"replicas": 2},
    }
    dev_cluster.admin.request(
        "PATCH",
        path,
        claim,
        content_type="application/apply-patch+yaml",
        params={"fieldManager": "baton-autoscaler"},
    )
    counts = {"prefill": 1, "decode": 2}
    res.wait_settled(key_of(body), counts, "decode at 2")
    changed = copy.deepcopy(body)
    changed["engine"]["dtype"] = "bfloat16"
    new_key = key_of(changed)
    access = ApiAccess.from_kubeconfig(dev_cluster.state.admin_kubeconfig)
    with Timeline(access, f"/api/v1/namespaces/{k8s_namespace}/pods") as pods:
        res.patch({"engine": {"dtype": "bfloat16"}})
        res.wait_settled(new_key, counts, "the new generation alone", timeout=180)
    rollout_invariants(pods, counts, new_key)
    for role, count in counts.items():
        deployment = res.deployment(role)
        assert deployment["spec"]["replicas"] == count
        managers = {
            m["manager"]
            for m in deployment["metadata"]["managedFields"]
            if "f:replicas" in (m.get("fieldsV1") or {}).get("f:spec", {})
        }
        assert managers == {"baton-autoscaler"}, role


def test_external_mode_rolls_decode_first_each_pool_with_its_own_strategy(
    dev_cluster: DevCluster, k8s_namespace: str, operator: OperatorProcess
) -> None:
    """HPA or KEDA own the replicas: nothing is released or stepped; the prefill Deployment
    stays paused until no decode pod of the old key is left."""
    res = Resource(dev_cluster, k8s_namespace, "ext")
    body = spec(1, 1, mode="external")
    res.create(body)
    res.wait_settled(key_of(body), {"prefill": 1, "decode": 1}, "the pools Ready")
    scale = f"/apis/apps/v1/namespaces/{k8s_namespace}/deployments/ext-decode/scale"
    merge = "application/merge-patch+json"
    hpa = {"fieldManager": "hpa"}
    dev_cluster.admin.request("PATCH", scale, {"spec": {"replicas": 2}}, content_type=merge, params=hpa)
    counts = {"prefill": 1, "decode": 2}
    res.wait_settled(key_of(body), counts, "decode at 2 (the HPA's)")
    access = ApiAccess.from_kubeconfig(dev_cluster.state.admin_kubeconfig)
    changed = copy.deepcopy(body)
    changed["engine"]["blockSize"] = 8
    new_key, old_key = key_of(changed), key_of(body)
    deployments = f"/apis/apps/v1/namespaces/{k8s_namespace}/deployments"
    with (
        Timeline(access, f"/api/v1/namespaces/{k8s_namespace}/pods") as pods,
        Timeline(access, f"/apis/apps/v1/namespaces/{k8s_namespace}/replicasets") as replica_sets,
        Timeline(access, deployments) as deploys,
    ):
        res.patch({"engine": {"blockSize": 8}})
        res.wait_settled(new_key, counts, "the new generation alone", timeout=180)
    assert not [rs for rs in replica_sets.ever() if LABEL_RETIRING in (rs["metadata"].get("labels") or {})]
    # Prefill's first new pod came once no old decode pod was left.
    for state in pods.states():
        live = [p for p in state.values() if role_of(p) in counts]
        if any(role_of(p) == contract.ROLE_PREFILL and key_of_pod(p) == new_key for p in live):
            assert not [p for p in live if role_of(p) == contract.ROLE_DECODE and key_of_pod(p) == old_key]
            break
    else:
        raise AssertionError("no new prefill pod was recorded")
    paused = [d for d in deploys.ever() if d["metadata"]["name"] == "ext-prefill" and d["spec"].get("paused")]
    assert paused, "the prefill Deployment was never paused"
    assert "paused" not in res.deployment("prefill")["spec"]


def test_a_stuck_rollout_is_rolled_forward_and_a_deleted_resource_takes_every_generation(
    dev_cluster: DevCluster, k8s_namespace: str, operator: OperatorProcess
) -> None:
    """A key change whose new pods cannot be scheduled stops at its first step (the old
    generation keeps serving); a further key change releases that generation too and rolls to
    the newest key; deleting the resource mid-rollout removes the released ReplicaSets (owned
    by the resource) with everything else."""
    res = Resource(dev_cluster, k8s_namespace, "stuck")
    body = spec(1, 1)
    res.create(body)
    counts = {"prefill": 1, "decode": 1}
    res.wait_settled(key_of(body), counts, "the pools Ready")
    nowhere = {cluster_spec.NODE_TYPE_LABEL: "no-such-node"}
    res.patch({"engine": {"blockSize": 32}, "decode": {"nodeSelector": nowhere}})

    def stuck() -> bool:
        pending = [p for p in res.pods("decode") if p["status"].get("phase") == "Pending"]
        return len(pending) == 1 and len(_released(res)) == 2

    wait_for(stuck, timeout=120, interval=0.5, message="the first step stuck on an unschedulable pod")
    assert [is_ready(p) for p in res.pods("prefill")] == [True]  # the old generation serves on

    def rolling_out() -> str:
        progressing = condition(res.get(), "Progressing") or {}
        return str(progressing.get("message", "")) if progressing.get("reason") == "RollingOut" else ""

    # The status follows the pods through the operator's debounced refresh, a moment after the
    # pods and ReplicaSets the watch saw: wait for it (it read "decode: 0/0 new" just before).
    wait_for(
        lambda: "decode: 0/1 new Ready, 1 old" in rolling_out(),
        timeout=60,
        interval=0.5,
        message="the Progressing condition reports the stuck step",
    )

    forward = copy.deepcopy(body)
    forward["engine"]["blockSize"] = 64
    res.patch({"engine": {"blockSize": 64}, "decode": {"nodeSelector": KWOK}})
    res.wait_settled(key_of(forward), counts, "rolled forward to the newest key", timeout=180)

    res.patch({"engine": {"blockSize": 16}, "decode": {"nodeSelector": nowhere}})
    wait_for(stuck, timeout=120, interval=0.5, message="stuck again")
    uid = res.get()["metadata"]["uid"]
    for rs in _released(res):  # the resource owns them now, the Deployment no longer does
        refs = rs["metadata"]["ownerReferences"]
        assert [(r["kind"], r["uid"], r["controller"]) for r in refs] == [("InferenceDeployment", uid, False)]
    dev_cluster.admin.delete(res.path)
    wait_for(
        lambda: not res.replica_sets() and not res.pods("prefill") and not res.pods("decode"),
        timeout=120,
        interval=0.5,
        message="garbage collection of every generation",
    )


@pytest.mark.parametrize("mode", ["off", "builtin"])
def test_a_rollback_mid_rollout_returns_to_the_old_key_within_the_bounds(
    dev_cluster: DevCluster, k8s_namespace: str, operator: OperatorProcess, mode: str
) -> None:
    """The user reverts a key change while it rolls (its new decode pod cannot be scheduled):
    the released old generation is taken back by the Deployments (its pods serve on, none is
    replaced), within the bounds on every recorded state; the generation rolled back from is
    released and removed, and no pod of it ever served."""
    res = Resource(dev_cluster, k8s_namespace, f"back-{mode}")
    body = spec(1, 1, mode=mode)
    res.create(body)
    old_key, counts = key_of(body), {"prefill": 1, "decode": 1}
    res.wait_settled(old_key, counts, "the pools Ready")
    nowhere = {cluster_spec.NODE_TYPE_LABEL: "no-such-node"}
    changed = copy.deepcopy(body)
    changed["engine"]["blockSize"] = 32
    new_key = key_of(changed)
    res.patch({"engine": {"blockSize": 32}, "decode": {"nodeSelector": nowhere}})

    def stuck() -> bool:
        pending = [p for p in res.pods("decode") if p["status"].get("phase") == "Pending"]
        return len(pending) == 1 and len(_released(res)) == 2

    wait_for(stuck, timeout=120, interval=0.5, message="the first step stuck on an unschedulable pod")
    serving = sorted(p["metadata"]["name"] for role in counts for p in res.pods(role) if is_ready(p))
    access = ApiAccess.from_kubeconfig(dev_cluster.state.admin_kubeconfig)
    with (
        Timeline(access, f"/api/v1/namespaces/{k8s_namespace}/pods") as pods,
        Timeline(access, f"/apis/apps/v1/namespaces/{k8s_namespace}/replicasets") as replica_sets,
    ):
        res.patch({"engine": {"blockSize": None}, "decode": {"nodeSelector": KWOK}})
        res.wait_settled(old_key, counts, "back at the old key alone", timeout=180)
    rollout_invariants(pods, counts, old_key)
    assert not [p for p in pods.ever() if key_of_pod(p) == new_key and is_ready(p)]
    # Taken back, not replaced: the old generation's pods serve on (their template is the
    # Deployments' again), no pod of the key was created.
    assert sorted(p["metadata"]["name"] for role in counts for p in res.pods(role)) == serving
    assert not [
        p for _, p in pods.snapshot()[1] if key_of_pod(p) == old_key and p["metadata"]["name"] not in serving
    ]
    for role in counts:
        deployment = res.deployment(role)
        assert deployment["spec"]["template"]["metadata"]["labels"][contract.LABEL_KV_COMPAT] == old_key
        assert "paused" not in deployment["spec"]
    pools = [rs for rs in res.replica_sets() if rs["metadata"]["labels"].get(contract.LABEL_ROLE) in counts]
    assert sorted(
        (rs["metadata"]["labels"][contract.LABEL_ROLE], rs["metadata"]["labels"][contract.LABEL_KV_COMPAT])
        for rs in pools
        if rs["spec"]["replicas"]
    ) == [("decode", old_key), ("prefill", old_key)]
    assert not _released(res)
    released_back = {
        rs["metadata"]["labels"].get(contract.LABEL_KV_COMPAT)
        for rs in replica_sets.ever()
        if LABEL_RETIRING in (rs["metadata"].get("labels") or {})
    }
    assert released_back == {old_key, new_key}
    status = res.get()["status"]
    for role in counts:
        assert (status[role]["kvCompatKey"], status[role]["newKeyPods"], status[role]["oldKeyPods"]) == (
            old_key,
            1,
            0,
        )
