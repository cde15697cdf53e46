"""One process node: registration (capacity, podCIDR, Ready), heartbeat Lease, and the pod
watch that starts and stops a PodWorker per bound pod."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import platform

from baton_dev.kubeapi import ApiError, JsonObject
from baton_dev.node_agent.context import HOST_IP, AgentContext, node_resources, now_micro, now_rfc3339
from baton_dev.node_agent.pod_worker import PodWorker
from baton_dev.spec import NODE_TYPE_LABEL

LEASE_DURATION_S = 40
LEASE_RENEW_S = 10.0
STATUS_HEARTBEAT_S = 60.0
KUBELET_VERSION = "v1.36.3"
log = logging.getLogger("baton_dev.node_agent")


class PodIpPool:
    """Addresses of the node's /24 podCIDR, handed out round-robin so that a deleted pod's
    address is not reused at once (its sockets may still linger)."""

    def __init__(self, cidr: str) -> None:
        self._hosts = [str(h) for h in ipaddress.ip_network(cidr).hosts()]
        self._used: set[str] = set()
        self._next = 0

    def allocate(self) -> str:
        for step in range(len(self._hosts)):
            ip = self._hosts[(self._next + step) % len(self._hosts)]
            if ip not in self._used:
                self._used.add(ip)
                self._next = (self._next + step + 1) % len(self._hosts)
                return ip
        raise RuntimeError("pod CIDR exhausted")

    def release(self, ip: str) -> None:
        self._used.discard(ip)


class ProcessNode:
    def __init__(self, ctx: AgentContext, name: str, pod_cidr: str, gpus: int) -> None:
        self.ctx = ctx
        self.name = name
        self.pod_cidr = pod_cidr
        self.gpus = gpus
        self.ips = PodIpPool(pod_cidr)
        self.workers: dict[str, tuple[PodWorker, asyncio.Task[None]]] = {}

    # --- registration --------------------------------------------------------------------------
    def _resources(self) -> JsonObject:
        return dict(node_resources(self.gpus))

    def _status(self) -> JsonObject:
        stamp = now_rfc3339()

        def cond(kind: str, status: str, reason: str, message: str) -> JsonObject:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }

        return {
            "capacity": self._resources(),
            "allocatable": self._resources(),
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "enough memory"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "enough PIDs"),
                cond("Ready", "True", "KubeletReady", "baton process node agent is posting ready status"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": HOST_IP},
                {"type": "Hostname", "address": self.name},
            ],
            "nodeInfo": {
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": platform.release(),
                "osImage": "baton process node",
                "containerRuntimeVersion": "baton-process://0.1",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(
                    platform.machine(), platform.machine()
                ),
            },
        }

    async def register(self) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    NODE_TYPE_LABEL: "process",
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "baton.dev/process-node": "true",
                },
            },
            "spec": {"podCIDR": self.pod_cidr, "podCIDRs": [self.pod_cidr]},
        }
        try:
            await self.ctx.api.post("/api/v1/nodes", body)
        except ApiError as e:
            if e.status != 409:
                raise
        await self.ctx.api.patch(f"/api/v1/nodes/{self.name}/status", {"status": self._status()})
        await self._renew_lease()

    async def _renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        spec = {
            "holderIdentity": self.name,
            "leaseDurationSeconds": LEASE_DURATION_S,
            "renewTime": now_micro(),
        }
        try:
            await self.ctx.api.patch(path, {"spec": spec})
        except ApiError as e:
            if e.status != 404:
                raise
            node = await self.ctx.api.get(f"/api/v1/nodes/{self.name}")
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": node["metadata"]["uid"]}
            await self.ctx.api.post(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {
                        "name": self.name,
                        "namespace": "kube-node-lease",
                        "ownerReferences": [owner],
                    },
                    "spec": spec,
                },
            )

    async def heartbeat(self) -> None:
        since_status = 0.0
        while True:
            await asyncio.sleep(LEASE_RENEW_S)
            since_status += LEASE_RENEW_S
            try:
                await self._renew_lease()
                if since_status >= STATUS_HEARTBEAT_S:
                    since_status = 0.0
                    await self.ctx.api.patch(f"/api/v1/nodes/{self.name}/status", {"status": self._status()})
            except Exception as e:  # keep beating: the API server may come back
                log.warning("node %s heartbeat failed: %s", self.name, e)

    # --- pods ----------------------------------------------------------------------------------
    async def watch_pods(self) -> None:
        while True:
            try:
                async for kind, obj in self.ctx.api.list_and_watch(
                    "/api/v1/pods", fieldSelector=f"spec.nodeName={self.name}"
                ):
                    if kind == "SYNC":
                        self._sync(obj["items"])
                    elif kind == "DELETED":
                        self._deleted(obj)
                    else:
                        self._observe(obj)
            except Exception as e:
                log.warning("node %s pod watch failed, restarting: %s", self.name, e)
                await asyncio.sleep(1.0)

    def _sync(self, pods: list[JsonObject]) -> None:
        present = {p["metadata"]["uid"] for p in pods}
        for uid, (worker, _) in list(self.workers.items()):
            if uid not in present:
                worker.deleted()
        for pod in pods:
            self._observe(pod)

    def _observe(self, pod: JsonObject) -> None:
        uid = pod["metadata"]["uid"]
        if uid in self.workers:
            self.workers[uid][0].update(pod)
            return
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") and not pod["metadata"].get(
            "deletionTimestamp"
        ):
            return  # finished before this agent started: nothing to run
        ip = HOST_IP if pod["spec"].get("hostNetwork") else self.ips.allocate()
        worker = PodWorker(self.ctx, self.name, pod, ip)
        worker.update(pod)
        task = asyncio.create_task(worker.run())
        self.workers[uid] = (worker, task)

        def done(t: asyncio.Task[None]) -> None:
            self.workers.pop(uid, None)
            if ip != HOST_IP:
                self.ips.release(ip)
            if not t.cancelled() and t.exception() is not None:
                log.error("pod %s worker failed", worker.key, exc_info=t.exception())

        task.add_done_callback(done)

    def _deleted(self, pod: JsonObject) -> None:
        entry = self.workers.get(pod["metadata"]["uid"])
        if entry is not None:
            entry[0].deleted()

    async def shutdown(self, grace_cap: float) -> None:
        entries = list(self.workers.values())
        await asyncio.gather(*(w.shutdown(grace_cap) for w, _ in entries), return_exceptions=True)
        for _, task in entries:
            task.cancel()
        await asyncio.gather(*(t for _, t in entries), return_exceptions=True)
