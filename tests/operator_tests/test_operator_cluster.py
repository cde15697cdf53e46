"""The operator on the full local control plane (API server, controller manager, scheduler, kwok
and process nodes): `helm install` runs it as a pod on a process node with the chart's
ServiceAccount; the examples are applied with kubectl into a PodSecurity `restricted` namespace;
engine pods are scheduled onto kwok GPU nodes (nothing runs there, kwok marks them Ready).

What the bare-API-server tests already prove (reconcile, drift, crash consistency, CEL refusals)
is not repeated: this module covers what needs the real controllers: ReplicaSets and pods
created under restricted admission, Ready from real pod readiness, a rolling update, garbage
collection by the controller manager, RBAC against the operator pod's own token, and an
operator-made router discovering operator-made engine pods. One chart install for the module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from baton_dev import spec as cluster_spec
from baton_dev.demo_manifests import PROCESS_NODES
from baton_dev.testing import DevCluster, condition, is_ready
from baton_support.wait import wait_for
from tests.operator_tests.placement import with_placement

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "baton"
RELEASE, OPERATOR_NS, OPERATOR_SA = "baton", "baton-system", "baton-operator"
KWOK_NODES = {cluster_spec.NODE_TYPE_LABEL: "kwok"}
KWOK_TOLERATIONS = [cluster_spec.KWOK_TOLERATION]
INSTANCE_TYPE = "node.kubernetes.io/instance-type"  # full.yaml's GPU nodes select mi300x
# Kinds the operator creates, with their API paths; ReplicaSets and Pods come from the controllers.
CHILD_KINDS = {
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "Service": "/api/v1/namespaces/{ns}/services",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "ReplicaSet": "/apis/apps/v1/namespaces/{ns}/replicasets",
    "Pod": "/api/v1/namespaces/{ns}/pods",
}


def load_example(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / name).read_text())
    return doc


def infd(cluster: DevCluster, namespace: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = cluster.admin.get(
        f"/apis/baton.dev/v1alpha1/namespaces/{namespace}/inferencedeployments/{name}"
    )
    return out


def is_ready_infd(cluster: DevCluster, namespace: str, name: str) -> bool:
    ready = condition(infd(cluster, namespace, name), "Ready")
    return ready is not None and ready["status"] == "True"


def owned_by(cluster: DevCluster, namespace: str, uids: set[str]) -> set[tuple[str, str]]:
    """(kind, name) of every object in `namespace` owned by one of `uids`, followed down the
    ownership chain (Deployment -> ReplicaSet -> Pod)."""
    found: set[tuple[str, str]] = set()
    owners = set(uids)
    for kind, path in CHILD_KINDS.items():  # ordered so owners come before what they own
        for item in cluster.admin.get(path.format(ns=namespace))["items"]:
            refs = {r["uid"] for r in item["metadata"].get("ownerReferences") or []}
            if refs & owners:
                found.add((kind, item["metadata"]["name"]))
                owners.add(item["metadata"]["uid"])
    return found


def expected_children(name: str) -> set[tuple[str, str]]:
    roles = ("prefill", "decode", "router")
    return {
        ("ServiceAccount", f"{name}-router"),
        ("Role", f"{name}-router"),
        ("RoleBinding", f"{name}-router"),
        ("NetworkPolicy", f"{name}-engines"),
        ("Secret", f"{name}-kv-transfer"),
        *(
            (kind, f"{name}-{role}")
            for kind in ("Service", "PodDisruptionBudget", "Deployment")
            for role in roles
        ),
    }


def without_controller_made(children: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(k, n) for k, n in children if k not in ("ReplicaSet", "Pod")}


def pod_kubeconfig(cluster: DevCluster, namespace: str, pod: str) -> Path:
    """The kubeconfig the process node wrote for a pod: its ServiceAccount's bound token."""
    (found,) = sorted(
        (cluster.state.agent_dir / "pods").glob(f"{namespace}_{pod}_*/serviceaccount/kubeconfig")
    )
    return found


def describe(cluster: DevCluster, namespace: str) -> str:
    """What a failed wait shows: pods, resources, events and the operator's log tail."""
    pods = cluster.kubectl("get", "pods", "-o", "wide", "-A").stdout
    infds = cluster.kubectl("get", "infd", "-n", namespace, "-o", "yaml").stdout
    events = cluster.kubectl("get", "events", "-n", namespace).stdout
    operator = "".join(
        p.read_text()[-3000:] for p in (cluster.state.agent_dir / "pods").glob(f"{OPERATOR_NS}_*/*.log")
    )
    return f"{pods}\n{infds}\n{events}\n{operator}"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def operator_pod(
    dev_cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """`helm install` of the chart as the docs say (no nodeSelector: only one replica and a short
    resync differ), which must put the operator on the process node: the kwok nodes, where
    nothing runs, are tainted for pods that do not opt in. Uninstalled afterwards."""
    values = tmp_path_factory.mktemp("chart") / "values.json"
    values.write_text(json.dumps({"replicaCount": 1, "resyncSeconds": 5}))
    dev_cluster.helm(
        "install", RELEASE, str(CHART), "-n", OPERATOR_NS, "--create-namespace", "-f", str(values)
    )
    try:
        pod = wait_for(
            lambda: next((p for p in dev_cluster.pods(OPERATOR_NS) if is_ready(p)), None),
            timeout=120,
            interval=0.5,
            message="the operator pod to be Ready",
        )
        yield pod
    finally:
        dev_cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NS, "--wait", "--timeout", "60s")
        dev_cluster.kubectl("delete", "namespace", OPERATOR_NS, "--wait=false")


@pytest.fixture(scope="module")
def gpu_nodes_labelled(dev_cluster: DevCluster) -> Iterator[list[str]]:
    """The kwok GPU nodes carry the instance-type label full.yaml selects (removed afterwards)."""
    nodes = [
        n["metadata"]["name"]
        for n in dev_cluster.admin.get("/api/v1/nodes", labelSelector="type=kwok")["items"]
    ]
    assert len(nodes) == 2
    dev_cluster.kubectl("label", "node", *nodes, f"{INSTANCE_TYPE}=mi300x")
    try:
        yield nodes
    finally:
        dev_cluster.kubectl("label", "node", *nodes, f"{INSTANCE_TYPE}-")


@pytest.fixture(scope="module")
def restricted_ns(dev_cluster: DevCluster) -> Iterator[str]:
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    with dev_cluster.namespace("infd-restricted", labels) as name:
        yield name


@pytest.fixture(scope="module")
def examples(
    dev_cluster: DevCluster, operator_pod: dict[str, Any], gpu_nodes_labelled: list[str], restricted_ns: str
) -> dict[str, str]:
    """minimal.yaml and full.yaml applied with kubectl, their engine pods and routers on kwok
    GPU nodes; returns example file -> resource name once both are Ready."""
    dev_cluster.kubectl(
        "create", "secret", "generic", "hf-token", "--from-literal=token=hf_x", "-n", restricted_ns
    )
    names = {}
    for path in ("minimal.yaml", "full.yaml"):
        doc = with_placement(load_example(path), KWOK_NODES, KWOK_TOLERATIONS)
        out = dev_cluster.kubectl("apply", "-n", restricted_ns, "-f", "-", stdin=json.dumps(doc)).stdout
        assert out.strip() == f"inferencedeployment.baton.dev/{doc['metadata']['name']} created"
        names[path] = doc["metadata"]["name"]
    for name in names.values():
        try:
            wait_for(
                lambda n=name: is_ready_infd(dev_cluster, restricted_ns, n),
                timeout=120,
                interval=0.5,
                message=f"{name} Ready",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{describe(dev_cluster, restricted_ns)}") from None
    return names


# --------------------------------------------------------------------------- tests


def test_operator_runs_from_the_chart_as_its_service_account(
    dev_cluster: DevCluster, operator_pod: dict[str, Any]
) -> None:
    assert operator_pod["spec"]["nodeName"] == cluster_spec.process_node_name(0)
    assert operator_pod["spec"]["serviceAccountName"] == OPERATOR_SA
    whoami = dev_cluster.kubectl(
        "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}",
        f"--kubeconfig={pod_kubeconfig(dev_cluster, OPERATOR_NS, operator_pod['metadata']['name'])}",
    )  # fmt: skip
    assert whoami.stdout == f"system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}"


def test_examples_reach_ready_with_their_children_and_columns(
    dev_cluster: DevCluster, examples: dict[str, str], restricted_ns: str
) -> None:
    for name in examples.values():
        body = infd(dev_cluster, restricted_ns, name)
        assert without_controller_made(owned_by(dev_cluster, restricted_ns, {body["metadata"]["uid"]})) == (
            expected_children(name)
        )
    minimal = infd(dev_cluster, restricted_ns, examples["minimal.yaml"])["status"]
    full = infd(dev_cluster, restricted_ns, examples["full.yaml"])["status"]
    counts = {r: (minimal[r]["ready"], full[r]["ready"]) for r in ("prefill", "decode", "router")}
    assert counts == {"prefill": ("1/1", "1/1"), "decode": ("1/1", "1/1"), "router": ("1/1", "2/2")}
    # full.yaml autoscales: replicas of its engine Deployments are the autoscaler's (1 by default).
    assert [full["observedGeneration"], minimal["observedGeneration"]] == [1, 1]

    table = dev_cluster.kubectl("get", "infd", "-n", restricted_ns).stdout.strip().splitlines()
    assert table[0].split() == ["NAME", "MODEL", "MODE", "PREFILL", "DECODE", "READY", "AGE"]
    rows = sorted(line.split()[:-1] for line in table[1:])
    assert rows == [
        ["llama3-8b", "meta-llama/Llama-3.1-8B-Instruct", "disaggregated", "1/1", "1/1", "True"],
        ["smollm2", "smollm2", "disaggregated", "1/1", "1/1", "True"],
    ]
    wide = dev_cluster.kubectl(
        "get", "infd", "smollm2", "-n", restricted_ns, "-o", "wide"
    ).stdout.splitlines()
    assert wide[0].split() == [
        "NAME",
        "MODEL",
        "MODE",
        "PREFILL",
        "DECODE",
        "POOL",
        "READY",
        "ENDPOINT",
        "AGE",
    ]
    # POOL is empty in disaggregated mode, so the row has one word fewer than the header.
    assert wide[1].split()[:-1] == [
        "smollm2", "smollm2", "disaggregated", "1/1", "1/1", "True", f"http://smollm2-router.{restricted_ns}.svc:80",
    ]  # fmt: skip


def test_engine_pods_pass_restricted_admission_on_gpu_nodes(
    dev_cluster: DevCluster, examples: dict[str, str], restricted_ns: str, gpu_nodes_labelled: list[str]
) -> None:
    pods = dev_cluster.pods(restricted_ns, "baton.dev/deployment=llama3-8b")
    roles = sorted(p["metadata"]["labels"]["baton.dev/role"] for p in pods)
    assert roles == ["decode", "prefill", "router", "router"]
    for pod in pods:
        assert pod["spec"]["nodeName"] in gpu_nodes_labelled and is_ready(pod)
        if pod["metadata"]["labels"]["baton.dev/role"] != "router":
            limits = pod["spec"]["containers"][0]["resources"]["limits"]
            assert limits[cluster_spec.GPU_RESOURCE] == "1"
    # The controllers met no refusal: no FailedCreate from the ReplicaSet controller.
    events = dev_cluster.admin.get(f"/api/v1/namespaces/{restricted_ns}/events")["items"]
    assert [e["message"] for e in events if e["reason"] == "FailedCreate"] == []
    # The control: the same namespace refuses a pod without the restricted settings.
    plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"}}
    plain["spec"] = {"containers": [{"name": "c", "image": "busybox"}]}
    refused = dev_cluster.kubectl(
        "apply", "-n", restricted_ns, "-f", "-", stdin=json.dumps(plain), check=False
    )
    assert refused.returncode == 1
    assert 'violates PodSecurity "restricted:latest"' in refused.stderr


def test_the_operator_is_refused_secrets(
    dev_cluster: DevCluster, operator_pod: dict[str, Any], examples: dict[str, str], restricted_ns: str
) -> None:
    sa = f"system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}"
    verdicts = {
        verb: dev_cluster.kubectl(
            "auth", "can-i", verb, "secrets", "-n", restricted_ns, f"--as={sa}", check=False
        )
        for verb in ("get", "list", "watch", "create", "patch")
    }
    assert {v: (r.returncode, r.stdout.strip()) for v, r in verdicts.items()} == {
        "get": (1, "no"), "list": (1, "no"), "watch": (1, "no"), "create": (0, "yes"), "patch": (0, "yes"),
    }  # fmt: skip
    kubeconfig = pod_kubeconfig(dev_cluster, OPERATOR_NS, operator_pod["metadata"]["name"])
    secret = f"{examples['minimal.yaml']}-kv-transfer"
    refused = dev_cluster.kubectl(
        "get", "secret", secret, "-n", restricted_ns, f"--kubeconfig={kubeconfig}", check=False
    )
    assert refused.returncode == 1
    assert f'User "{sa}" cannot get resource "secrets"' in refused.stderr
    # It exists (the operator created it): the refusal is RBAC, not a missing object.
    dev_cluster.kubectl("get", "secret", secret, "-n", restricted_ns)


def test_a_pool_the_scheduler_cannot_place_says_so(
    dev_cluster: DevCluster, operator_pod: dict[str, Any], restricted_ns: str, gpu_nodes_labelled: list[str]
) -> None:
    """A decode pool asking for more GPUs than any node has: the real scheduler's verdict is the
    reason and message of Ready and Degraded (not 'RollingOut' and 'no failures observed')."""
    doc = with_placement(load_example("minimal.yaml"), KWOK_NODES, KWOK_TOLERATIONS)
    doc["metadata"]["name"] = "greedy"
    doc["spec"]["decode"] = {**doc["spec"].get("decode", {}), "resources": {"gpus": 64}}
    dev_cluster.apply(doc, restricted_ns)

    def degraded() -> dict[str, Any] | None:
        found = condition(infd(dev_cluster, restricted_ns, "greedy"), "Degraded")
        return found if found is not None and found["reason"] == "PodsUnschedulable" else None

    try:
        stuck = wait_for(degraded, timeout=120, interval=0.5, message="Degraded=True PodsUnschedulable")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe(dev_cluster, restricted_ns)}") from None
    (pod,) = dev_cluster.pods(restricted_ns, "baton.dev/deployment=greedy,baton.dev/role=decode")
    scheduled = condition(pod, "PodScheduled")
    assert scheduled is not None and scheduled["reason"] == "Unschedulable"
    assert stuck["status"] == "True"
    assert (
        stuck["message"] == f"decode: pod {pod['metadata']['name']} is unschedulable: {scheduled['message']}"
    )
    assert "Insufficient amd.com/gpu" in scheduled["message"]
    ready = condition(infd(dev_cluster, restricted_ns, "greedy"), "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("False", "PodsUnschedulable")
    dev_cluster.kubectl("delete", "infd", "greedy", "-n", restricted_ns)


def test_router_discovers_operator_pods_and_drops_a_deleted_one(
    dev_cluster: DevCluster, operator_pod: dict[str, Any], restricted_ns: str, gpu_nodes_labelled: list[str]
) -> None:
    """An operator-made router, running on the process node with its own ServiceAccount, watches
    the operator-made engine pods on kwok nodes; a request goes to the pod it discovered (the
    connection is refused there: nothing runs on kwok); once that pod is deleted the router has
    no decode pod until the ReplicaSet's replacement is Ready (it holds requests meanwhile), and
    then routes to that."""
    doc = with_placement(load_example("minimal.yaml"), KWOK_NODES, KWOK_TOLERATIONS)
    doc["metadata"]["name"] = "routed"
    doc["spec"]["router"]["nodeSelector"] = PROCESS_NODES
    dev_cluster.apply(doc, restricted_ns)

    def running_router() -> dict[str, Any] | None:
        pods = dev_cluster.pods(restricted_ns, "baton.dev/deployment=routed,baton.dev/role=router")
        return next(
            (p for p in pods if p["status"].get("podIP") and p["status"].get("phase") == "Running"), None
        )

    router = wait_for(running_router, timeout=120, interval=0.5, message="the router pod running")
    url = f"http://{router['status']['podIP']}:8080/v1/chat/completions"

    def decode_pods() -> list[dict[str, Any]]:
        return dev_cluster.pods(restricted_ns, "baton.dev/deployment=routed,baton.dev/role=decode")

    def router_error() -> str:
        """The router's 503 message for a short chat (it goes straight to decode: the direct leg)."""
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        try:
            answer = httpx.post(url, json=body, timeout=10)
        except httpx.TransportError as exc:
            return repr(exc)
        return str(answer.json()["error"]["message"]) if answer.status_code == 503 else answer.text

    def router_metrics() -> str:
        return httpx.get(url.replace("/v1/chat/completions", "/metrics"), timeout=10).text

    def refused_by(pod: dict[str, Any]) -> bool:
        prefix = f"direct leg: no pod accepted the connection (http://{pod['status']['podIP']}:8000: "
        return router_error().startswith(prefix)

    first = wait_for(
        lambda: [p for p in decode_pods() if is_ready(p)],
        timeout=60,
        interval=0.5,
        message="one Ready decode pod",
    )[0]
    wait_for(
        lambda: refused_by(first),
        timeout=60,
        interval=0.5,
        message="the router to try the discovered decode pod",
    )
    # Its replacement must not take its place (kwok reuses the IP): hold it Pending.
    dev_cluster.kubectl("cordon", *gpu_nodes_labelled)
    try:
        dev_cluster.kubectl("delete", "pod", first["metadata"]["name"], "-n", restricted_ns)
        # With no decode pod the router holds requests (until one is back) rather than failing
        # them: that it dropped the deleted pod shows in its endpoint count.
        wait_for(
            lambda: 'baton_router_endpoints{role="decode"} 0.0' in router_metrics().splitlines(),
            timeout=60,
            interval=0.5,
            message="the router to drop the deleted pod",
        )
        # The router drops the pod as soon as it is gone; the ReplicaSet controller creates the
        # replacement on its own schedule.
        (pending,) = wait_for(
            decode_pods, timeout=60, interval=0.5, message="the ReplicaSet's replacement decode pod"
        )
        assert (pending["status"]["phase"], pending["metadata"]["uid"] != first["metadata"]["uid"]) == (
            "Pending",
            True,
        )
    finally:
        dev_cluster.kubectl("uncordon", *gpu_nodes_labelled)

    def replacement() -> dict[str, Any] | None:
        ready = [p for p in decode_pods() if is_ready(p) and p["metadata"]["uid"] != first["metadata"]["uid"]]
        return ready[0] if ready else None

    second = wait_for(replacement, timeout=60, interval=0.5, message="the replacement decode pod Ready")
    wait_for(
        lambda: refused_by(second), timeout=60, interval=0.5, message="the router to try the replacement"
    )
    assert 'baton_router_endpoints{role="decode"} 1.0' in router_metrics().splitlines()
    dev_cluster.kubectl("delete", "infd", "routed", "-n", restricted_ns)


def test_changing_an_engine_setting_rolls_the_pods(
    dev_cluster: DevCluster, examples: dict[str, str], restricted_ns: str
) -> None:
    name = examples["minimal.yaml"]
    selectors = {role: f"baton.dev/deployment={name},baton.dev/role={role}" for role in ("prefill", "decode")}
    old_hash = {
        role: dev_cluster.pods(restricted_ns, sel)[0]["metadata"]["labels"]["pod-template-hash"]
        for role, sel in selectors.items()
    }
    patch = json.dumps({"spec": {"engine": {"maxNumSeqs": 17}}})  # shared by both roles
    dev_cluster.kubectl("patch", "infd", name, "-n", restricted_ns, "--type=merge", "-p", patch)

    for role, selector in selectors.items():

        def rolled(selector: str = selector, role: str = role) -> dict[str, Any] | None:
            pods = dev_cluster.pods(restricted_ns, selector)
            new = len(pods) == 1 and pods[0]["metadata"]["labels"]["pod-template-hash"] != old_hash[role]
            return pods[0] if new and is_ready(pods[0]) else None

        after = wait_for(
            rolled,
            timeout=90,
            interval=0.5,
            message=f"one Ready {role} pod of a new ReplicaSet, the old pod gone",
        )
        args = after["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "17"
        replicasets = dev_cluster.admin.get(
            f"/apis/apps/v1/namespaces/{restricted_ns}/replicasets", labelSelector=selector
        )
        by_hash = {
            rs["metadata"]["labels"]["pod-template-hash"]: rs["spec"]["replicas"]
            for rs in replicasets["items"]
        }
        assert by_hash == {old_hash[role]: 0, after["metadata"]["labels"]["pod-template-hash"]: 1}
    wait_for(
        lambda: (
            is_ready_infd(dev_cluster, restricted_ns, name)
            and infd(dev_cluster, restricted_ns, name)["status"]["observedGeneration"] == 2
        ),
        timeout=60,
        interval=0.5,
        message="Ready again at generation 2",
    )


def test_deleting_the_resource_removes_every_child(
    dev_cluster: DevCluster, examples: dict[str, str], restricted_ns: str
) -> None:
    name = examples["minimal.yaml"]
    uid = infd(dev_cluster, restricted_ns, name)["metadata"]["uid"]
    children = owned_by(dev_cluster, restricted_ns, {uid})
    kinds = sorted({k for k, _ in children})
    assert kinds == sorted(CHILD_KINDS)
    dev_cluster.kubectl("delete", "infd", name, "-n", restricted_ns)  # no finalizer: returns at once
    remaining = {(k, n) for k, n in children}

    def gone() -> bool:
        present = set()
        for kind, path in CHILD_KINDS.items():
            items = dev_cluster.admin.get(path.format(ns=restricted_ns))["items"]
            present |= {(kind, i["metadata"]["name"]) for i in items}
        return not (remaining & present)

    wait_for(
        gone,
        timeout=90,
        interval=0.5,
        message="the controller manager's garbage collector to delete every child",
    )
    # The other example's children are untouched.
    full = infd(dev_cluster, restricted_ns, examples["full.yaml"])
    assert without_controller_made(owned_by(dev_cluster, restricted_ns, {full["metadata"]["uid"]})) == (
        expected_children(examples["full.yaml"])
    )
