"""The agent's list+watch survives the server ending each watch (it resumes from the last seen
resource version: no event lost, none repeated)."""

from __future__ import annotations

import asyncio

import pytest

from baton_dev.kubeapi import ApiAccess, AsyncKubeApi
from baton_dev.testing import DevCluster

pytestmark = pytest.mark.k8s


def test_watch_resumes_after_server_timeout(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    path = f"/api/v1/namespaces/{ns}/configmaps"

    async def run() -> list[tuple[str, str]]:
        api = AsyncKubeApi(ApiAccess.from_kubeconfig(dev_cluster.state.admin_kubeconfig))
        seen: list[tuple[str, str]] = []
        try:
            watch = api.list_and_watch(path, watch_timeout_s=1, labelSelector="t=watch")
            kind, listing = await anext(watch)
            seen.append((kind, str(len(listing["items"]))))
            for i in range(3):
                # Each create comes after the previous 1 s watch window has closed.
                await asyncio.sleep(1.2)
                await api.post(path, {"metadata": {"name": f"cm{i}", "labels": {"t": "watch"}}})
                kind, obj = await asyncio.wait_for(anext(watch), 10)
                seen.append((kind, obj["metadata"]["name"]))
            await watch.aclose()
        finally:
            await api.aclose()
        return seen

    assert asyncio.run(run()) == [("SYNC", "0"), ("ADDED", "cm0"), ("ADDED", "cm1"), ("ADDED", "cm2")]
