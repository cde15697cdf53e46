"""The KV-event index of the discovered pods: subscribe when a pod appears, drop it when it goes.

Wraps ``baton_engine.prefix.subscriber.KVEventSubscriber`` (its own thread and ZMQ sockets),
keyed by ``Endpoint.key``, so a restarted pod (new uid or IP, hence a new key) starts from an
empty index and its predecessor's entries go with it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from baton_engine import contract
from baton_engine.prefix.subscriber import KVEventSubscriber, PodStreamStats
from baton_engine.router.endpoints import Endpoint, EndpointRegistry, EventKind

log = logging.getLogger(__name__)


def zmq_address(endpoint: Endpoint, port_name: str) -> str:
    host = endpoint.host
    return (
        f"tcp://[{host}]:{endpoint.port(port_name)}"
        if ":" in host
        else f"tcp://{host}:{endpoint.port(port_name)}"
    )


class KVEventIndex:
    """A `router.prefix.PrefixMatcher` fed by every engine pod's KV events."""

    def __init__(self, subscriber: KVEventSubscriber | None = None) -> None:
        self.subscriber = subscriber or KVEventSubscriber()
        # one worker: a pod's subscribe and unsubscribe (both block briefly) stay in order
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-router-kv-index")

    def attach(self, registry: EndpointRegistry) -> None:
        registry.subscribe(self._on_endpoint)

    def _on_endpoint(self, kind: EventKind, endpoint: Endpoint) -> None:
        if endpoint.role == contract.ROLE_DECODE:
            return  # prefill choice only; decode pods' caches are filled by transfers
        self._worker.submit(self._add if kind == "added" else self._remove, endpoint)

    def _add(self, endpoint: Endpoint) -> None:
        try:
            self.subscriber.add_pod(
                endpoint.key,
                zmq_address(endpoint, contract.PORT_KV_EVENTS),
                replay_endpoint=zmq_address(endpoint, contract.PORT_KV_EVENTS_REPLAY),
            )
        except Exception:
            log.exception("cannot subscribe to KV events of %s", endpoint.name)

    def _remove(self, endpoint: Endpoint) -> None:
        try:
            self.subscriber.remove_pod(endpoint.key)
        except Exception:
            log.exception("cannot unsubscribe from KV events of %s", endpoint.name)

    def stats(self) -> dict[str, PodStreamStats]:
        """Each subscribed pod's stream stats (copies), by endpoint key."""
        found = {}
        for pod in self.subscriber.pods():
            try:
                found[str(pod)] = self.subscriber.stats(pod)
            except KeyError:  # the pod went between the two calls
                continue
        return found

    def health(self) -> dict[str, dict[str, object]]:
        """What the router's /ready reports of each pod's KV-event stream."""
        return {
            pod: {
                "next_sequence": s.next_seq,
                "batches_applied": s.batches_applied,
                "rejected_batches": s.rejected_batches,
                "encoding": s.encoding,
                "last_error": s.last_error,
            }
            for pod, s in self.stats().items()
        }

    def longest_prefix_match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        return {str(pod): n for pod, n in self.subscriber.longest_prefix_match(block_hashes).items()}

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self.subscriber.close()
