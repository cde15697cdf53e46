"""`baton-operator run`: Kopf settings, the API client, metrics, liveness and peering."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import httpx
import kopf
from prometheus_client import start_http_server

from baton_operator import handlers, metrics
from baton_operator.coalesce import Coalescer
from baton_operator.kube import Kube
from baton_operator.reconcile import Caches, OperatorConfig

#: Kopf's bookkeeping annotations (progress, last-handled configuration) live under this prefix.
ANNOTATION_PREFIX = "baton.dev"
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True)
class RunOptions:
    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = True
    metrics_port: int = 0
    health_port: int = 8081
    bind: str = "0.0.0.0"
    peering: str | None = "baton-operator"
    resync_seconds: float = 60.0
    monitoring_namespace: str = ""
    verbose: bool = False


def own_namespace() -> str:
    """The operator pod's namespace (downward API env, else the service-account mount)."""
    if ns := os.environ.get("POD_NAMESPACE"):
        return ns
    try:
        with open(NAMESPACE_FILE) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def peering_priority() -> int:
    """Higher for replicas started earlier; microseconds make ties practically impossible."""
    return -(time.time_ns() // 1000)


def configure(settings: kopf.OperatorSettings, options: RunOptions) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = (
        f"{ANNOTATION_PREFIX}/kopf-finalizer"  # never added: no deletion handlers
    )
    # Kubernetes Events: Baton's own (kopf.event) and Kopf's warnings and errors. Kopf's INFO
    # lines ("Handler 'reconcile' succeeded.", "Creation is processed") would add two Event
    # writes per reconcile that say nothing the `Reconciled` Event does not.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    if options.peering:
        settings.peering.name = options.peering
        settings.peering.mandatory = True
        settings.peering.clusterwide = options.all_namespaces
        settings.peering.stealth = True
        # Kopf pauses *every* peer that sees another with its own priority, so replicas need
        # distinct ones: the earliest started (highest priority) stays the active one.
        settings.peering.priority = peering_priority()
    else:
        settings.peering.standalone = True


def build_registry(options: RunOptions) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    handlers.register(registry, options.resync_seconds)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # A custom registry has no default login handler: in-cluster first, then the kubeconfig.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure(settings, options)
        memo["kube"] = kube = Kube()
        memo["caches"] = caches = Caches()
        memo["refresher"] = handlers.status_refresher(kube, caches)
        memo["reconcile_slots"] = asyncio.Semaphore(handlers.MAX_CONCURRENT_RECONCILES)
        # One client for every engine scrape (creating one costs ~0.1 s); pods are plain HTTP.
        memo["scrape_client"] = httpx.AsyncClient(trust_env=False)
        memo["config"] = OperatorConfig(
            operator_namespace=own_namespace(), monitoring_namespace=options.monitoring_namespace
        )
        metrics.ACTIVE.set(1)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        refresher: Coalescer | None = memo.get("refresher")
        if refresher is not None:
            await refresher.close()
        kube: Kube | None = memo.get("kube")
        if kube is not None:
            await kube.close()
        client: httpx.AsyncClient | None = memo.get("scrape_client")
        if client is not None:
            await client.aclose()
        metrics.ACTIVE.set(0)

    return registry


class _QuietSuccesses(logging.Filter):
    """Drops Kopf's success line of the watch-event handlers: they run for every version of every
    owner and child Deployment, and have nothing to report."""

    QUIET = frozenset(
        f"Handler '{handler_id}' succeeded."
        for handler_id in (handlers.OWNER_EVENTS_ID, handlers.CHILD_EVENTS_ID)
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and record.getMessage() in self.QUIET)


def run(options: RunOptions) -> int:
    logging.basicConfig(
        level=logging.DEBUG if options.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_QuietSuccesses())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per engine scrape otherwise
    if options.metrics_port:
        start_http_server(options.metrics_port, addr=options.bind)
    liveness = f"http://{options.bind}:{options.health_port}/healthz" if options.health_port else None
    asyncio.run(
        kopf.operator(
            registry=build_registry(options),
            clusterwide=options.all_namespaces,
            namespaces=list(options.namespaces),
            liveness_endpoint=liveness,
            peering_name=options.peering,
            standalone=options.peering is None,
            memo=kopf.Memo(),
        )
    )
    return 0
