"""`baton-operator run`: Kopf settings, the API client, metrics, liveness and peering."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import httpx
import kopf
from prometheus_client import start_http_server

from baton_operator import handlers, metrics
from baton_operator.autoscaler.job import AutoscalerJob
from baton_operator.events import Event
from baton_operator.kube import Kube
from baton_operator.memo import OperatorMemo
from baton_operator.peering import PeerView
from baton_operator.reconcile import Caches, OperatorConfig
from baton_operator.reconcile_job import ReconcileJob, ReconcileSettings
from baton_operator.workers import Job, ResourceId, ResourceWorkers

#: Reconciles running at once. The API server sets the pace of a burst anyway; past this, more
#: at once only hold more state, and finish together.
MAX_CONCURRENT_RECONCILES = 32

#: Kopf's bookkeeping annotations (progress, last-handled configuration) live under this prefix.
ANNOTATION_PREFIX = "baton.dev"
#: Where Kopf records the spec it last handled (its diff base): written once a creation is handled.
LAST_HANDLED_KEY = "last-handled-configuration"
LAST_HANDLED_ANNOTATION = f"{ANNOTATION_PREFIX}/{LAST_HANDLED_KEY}"
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


def own_identity() -> str:
    """This replica's Kopf peering identity: the pod name where there is one, and the process."""
    host = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{host}/{os.getpid()}/{time.time_ns() // 1000}"


def peering_priority() -> int:
    """Higher for replicas started earlier; microseconds make ties practically impossible."""
    return -(time.time_ns() // 1000)


def configure(settings: kopf.OperatorSettings, options: RunOptions) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key=LAST_HANDLED_KEY
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
    handlers.register(registry)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # A custom registry has no default login handler: in-cluster first, then the kubeconfig.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: OperatorMemo, **_: Any) -> None:
        configure(settings, options)
        memo.peers.priority = settings.peering.priority
        memo.peers.start()
        metrics.ACTIVE.set(1)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: OperatorMemo, **_: Any) -> None:
        # Stop what uses the API client before closing it: the jobs first (a reconcile in
        # flight would otherwise fail on a closed session), then the refreshes, then the peers.
        await memo.workers.close()
        await memo.refresher.close()
        await memo.peers.close()
        metrics.ACTIVE.set(0)

    return registry


def peering_paths(options: RunOptions) -> list[str]:
    """API paths of the Kopf peering objects this replica takes part in (none: standalone)."""
    if not options.peering:
        return []
    if options.all_namespaces:
        return [f"/apis/kopf.dev/v1/clusterkopfpeerings/{options.peering}"]
    return [f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/{options.peering}" for ns in options.namespaces]


def post_event(body: Mapping[str, Any], event: Event) -> None:
    """Post through Kopf's queue (the caller runs in a task started inside Kopf's handling)."""
    raw = cast(kopf.RawBody, dict(body))
    kopf.event(kopf.Body(raw), type=event.type, reason=event.reason, message=event.message)


def build_memo(options: RunOptions, identity: str) -> OperatorMemo:
    """Everything the handlers share; created inside the event loop, before Kopf starts."""
    kube = Kube(on_request=metrics.count_api_request)
    caches = Caches()
    config = OperatorConfig(
        operator_namespace=own_namespace(), monitoring_namespace=options.monitoring_namespace
    )
    scrape_client = httpx.AsyncClient(trust_env=False)
    reconciles = ReconcileSettings(
        kube=kube,
        caches=caches,
        config=config,
        slots=asyncio.Semaphore(MAX_CONCURRENT_RECONCILES),
        resync_s=options.resync_seconds,
        post=post_event,
    )

    def jobs(resource: ResourceId) -> list[Job]:
        now = asyncio.get_running_loop().time()
        return [ReconcileJob(reconciles, now), AutoscalerJob(kube, scrape_client, post_event)]

    def is_live(resource: ResourceId) -> bool:
        return caches.owners.uid(resource.namespace, resource.name) == resource.uid

    # The priority is set at startup, once `configure` has chosen it.
    peers = PeerView(kube, peering_paths(options), identity, priority=0)
    return OperatorMemo(
        kube=kube,
        caches=caches,
        config=config,
        refresher=handlers.status_refresher(kube, caches),
        workers=ResourceWorkers(jobs, is_live, peers.active),
        peers=peers,
        scrape_client=scrape_client,
    )


class _QuietSuccesses(logging.Filter):
    """Drops Kopf's success line of the watch-event handlers: they run for every version of every
    owner and child Deployment, and have nothing to report."""

    QUIET = frozenset(
        f"Handler '{handler_id}' succeeded."
        for handler_id in (handlers.OWNER_EVENTS_ID, handlers.CHILD_EVENTS_ID, handlers.POD_EVENTS_ID)
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
    asyncio.run(serve(options))
    return 0


async def serve(options: RunOptions) -> None:
    """Run the operator until it is told to stop; the API clients are closed after Kopf is."""
    liveness = f"http://{options.bind}:{options.health_port}/healthz" if options.health_port else None
    identity = own_identity()
    memo = build_memo(options, identity)
    try:
        await kopf.operator(
            registry=build_registry(options),
            clusterwide=options.all_namespaces,
            namespaces=list(options.namespaces),
            liveness_endpoint=liveness,
            peering_name=options.peering,
            standalone=options.peering is None,
            # Kopf types it as its own NewType of str, which it does not export.
            identity=identity,  # type: ignore[arg-type]
            memo=memo,
        )
    finally:
        await memo.workers.close()
        await memo.refresher.close()
        await memo.peers.close()
        await memo.scrape_client.aclose()
        await memo.kube.close()
