"""The router's state and choices: endpoints, their load, prefix scores, in-flight counts."""

from __future__ import annotations

import asyncio
from collections import Counter as Tally
from collections.abc import Mapping, Sequence
from typing import Any

from baton_engine import contract
from baton_engine.router import policy
from baton_engine.router.endpoints import Endpoint, EndpointRegistry
from baton_engine.router.hold import HoldQueue
from baton_engine.router.load import LoadTracker
from baton_engine.router.metrics import RouterMetrics
from baton_engine.router.prefix import Api, PrefixScorer
from baton_engine.router.settings import RouterSettings


class NoEndpoint(LookupError):
    """No pod of a needed role is known (of the needed KV-compatibility key, if `paired`)."""

    def __init__(self, role: str, message: str | None = None, *, paired: bool = False) -> None:
        super().__init__(message or f"no {role} pod available")
        self.role = role
        self.paired = paired


class RouterCore:
    def __init__(
        self,
        settings: RouterSettings,
        registry: EndpointRegistry,
        loads: LoadTracker,
        scorer: PrefixScorer,
        metrics: RouterMetrics,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.loads = loads
        self.scorer = scorer
        self.metrics = metrics
        self.in_flight: Tally[str] = Tally()
        self.background: set[asyncio.Future[None]] = set()  # fire-and-forget calls (lease releases)
        self._prefill_weights = settings.prefill_weights
        self._turns: Tally[str] = Tally()
        self.hold = HoldQueue(
            registry,
            metrics,
            capacity=settings.hold_queue,
            timeout_s=settings.hold_timeout_s,
            retry_after_s=settings.hold_retry_after_s,
        )
        registry.subscribe(self._on_endpoint)

    def _on_endpoint(self, kind: str, endpoint: Endpoint) -> None:
        if kind == "removed":
            self.in_flight.pop(endpoint.key, None)
        for role in contract.ENGINE_ROLES:
            self.metrics.endpoints.labels(role=role).set(len(self.registry.by_role(role)))

    def _candidates(self, endpoints: Sequence[Endpoint], prefix: Mapping[str, int]) -> list[policy.Candidate]:
        out = []
        for e in endpoints:
            load = self.loads.get(e.key)
            out.append(
                policy.Candidate(
                    key=e.key,
                    prefix_blocks=prefix.get(e.key, 0),
                    waiting=load.waiting,
                    running=load.running,
                    kv_usage=load.kv_usage,
                    in_flight=self.in_flight[e.key],
                    block_size=e.block_size,
                )
            )
        return out

    def _usable(self, role: str, kv_key: str | None = None) -> list[Endpoint]:
        """The role's endpoints (of KV-compatibility key `kv_key` unless None), less those the last
        scrape could not connect to (unless that is all)."""
        endpoints = self.registry.by_role(role, kv_key)
        if not endpoints:
            if kv_key is not None and self.registry.by_role(role):
                raise NoEndpoint(role, f"no {role} pod of KV-compatibility key {kv_key!r}", paired=True)
            raise NoEndpoint(role)
        reachable = [e for e in endpoints if self.loads.get(e.key).reachable]
        return reachable or endpoints

    def _paired_prefill(self) -> list[Endpoint]:
        """Prefill pods that share their KV-compatibility key with at least one decode pod: only
        those can hand their KV over (during a rollout, pods of two keys serve side by side)."""
        prefill = self._usable(contract.ROLE_PREFILL)
        decode_keys = {e.kv_key for e in self.registry.by_role(contract.ROLE_DECODE)}
        paired = [e for e in prefill if e.kv_key in decode_keys]
        if not paired:
            keys = ", ".join(sorted(repr(k) for k in decode_keys)) or "none"
            raise NoEndpoint(
                contract.ROLE_PREFILL,
                f"no prefill pod shares a KV-compatibility key with a decode pod (decode keys: {keys})",
                paired=True,
            )
        return paired

    def _turn(self, role: str) -> int:
        turn = self._turns[role]
        self._turns[role] += 1
        return turn

    def choose_first_leg(self, api: Api, body: Mapping[str, Any]) -> tuple[Endpoint, int]:
        """The prefill pod (aggregated: the pod) and its cached prompt tokens for this request."""
        if self.settings.mode == "aggregated":
            role, endpoints = contract.ROLE_AGGREGATED, self._usable(contract.ROLE_AGGREGATED)
        else:
            role, endpoints = contract.ROLE_PREFILL, self._paired_prefill()
        prefix = self.scorer.matched_blocks(api, body, endpoints) if self.settings.routing == "prefix" else {}
        chosen = policy.choose_prefill(
            self._candidates(endpoints, prefix),
            self.settings.routing,
            self._turn(role),
            self._prefill_weights,
        )
        endpoint = self.registry.get(chosen.key)
        assert endpoint is not None
        hit_tokens = chosen.prefix_blocks * (endpoint.block_size or self.settings.block_size)
        if hit_tokens:
            self.metrics.prefix_hit_tokens.inc(hit_tokens)
        return endpoint, hit_tokens

    def decode_order(self, kv_key: str | None = None) -> list[Endpoint]:
        """Decode pods to try, best first (at most ``decode_attempts``): only those of
        KV-compatibility key `kv_key` (the prefill pod's) unless it is None (a whole request)."""
        role = contract.ROLE_DECODE
        endpoints = self._usable(role, kv_key)
        candidates = self._candidates(endpoints, {})
        turn = self._turn(role)
        if self.settings.routing == "round-robin":
            first = policy.choose_decode(candidates, "round-robin", turn)
            ranked = [first] + [c for c in sorted(candidates, key=lambda c: c.key) if c.key != first.key]
        else:
            ranked = policy.rank_decode(candidates, turn)
        picked = [self.registry.get(c.key) for c in ranked[: self.settings.decode_attempts]]
        return [e for e in picked if e is not None]

    @property
    def needed_role(self) -> str:
        """The pool no request can do without: decode (a prefill pod alone cannot answer), or
        the aggregated pool."""
        return contract.ROLE_AGGREGATED if self.settings.mode == "aggregated" else contract.ROLE_DECODE

    def ready_roles(self) -> dict[str, int]:
        """Reachable endpoints per needed role (never-scraped endpoints count as reachable)."""
        return {
            role: sum(1 for e in self.registry.by_role(role) if self.loads.get(e.key).reachable)
            for role in self.settings.roles
        }
