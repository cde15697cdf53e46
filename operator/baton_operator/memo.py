"""What every Kopf handler of the operator shares: Kopf's `memo`, typed.

Kopf gives each resource a shallow copy of the memo it was started with, so every field is the
same object for every resource; per-resource state lives in the resource's jobs (`workers`)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from baton_operator.coalesce import Coalescer
from baton_operator.kube import Kube
from baton_operator.peering import PeerView
from baton_operator.reconcile import Caches, OperatorConfig
from baton_operator.workers import ResourceWorkers


@dataclass
class OperatorMemo:
    kube: Kube  # the API client of every write and read (Kopf's watches use their own)
    caches: Caches  # the owners and child Deployments the watches showed
    config: OperatorConfig
    refresher: Coalescer  # one status refresh per burst of child changes, per resource
    workers: ResourceWorkers  # the reconcile and autoscaler jobs of every live resource
    peers: PeerView  # whether this replica is the active peer (the jobs run only then)
    scrape_client: httpx.AsyncClient  # every engine /metrics scrape (one pool; pods are plain HTTP)
