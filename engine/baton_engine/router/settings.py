"""The router's settings (built by the CLI, or directly by tests and benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from baton_engine import contract
from baton_engine.router.policy import ROUTINGS, PrefillWeights, Routing

Mode = Literal["disaggregated", "aggregated"]
MODES: tuple[str, ...] = ("disaggregated", "aggregated")


@dataclass(frozen=True)
class RouterSettings:
    mode: Mode = "disaggregated"
    routing: Routing = "prefix"
    block_size: int = 16
    prefix_weight: float = PrefillWeights.prefix  # prefill score per cached prompt token
    load_weight: float = PrefillWeights.load  # prefill score subtracted per outstanding request
    model: str | None = None  # served model name, used for /v1/models when no upstream answers
    api_key: str | None = None  # None: no client authentication
    prefill_timeout_s: float = 60.0  # whole prefill leg
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # longest silence tolerated inside a streamed answer
    max_connections: int = 1024  # upstream pool size (all pods together)
    decode_attempts: int = 2  # decode pods tried when a pod refuses the connection
    scrape_interval_s: float = 1.0
    scrape_timeout_s: float = 0.5
    scrape_concurrency: int = 16
    hold_queue: int = 64  # requests held at most while a needed pool has no pod (0: 503 at once)
    hold_timeout_s: float = 120.0  # longest one request is held
    hold_retry_after_s: float = 5.0  # Retry-After of the 503 a request gets when it cannot be held

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing: {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if self.block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {self.block_size}")
        _ = self.prefill_weights  # validates the weights
        timeouts = ("prefill_timeout_s", "connect_timeout_s", "read_timeout_s", "scrape_interval_s")
        for name in (*timeouts, "hold_timeout_s", "hold_retry_after_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.max_connections <= 0 or self.decode_attempts <= 0 or self.scrape_concurrency <= 0:
            raise ValueError("max_connections, decode_attempts and scrape_concurrency must be positive")
        if self.hold_queue < 0:
            raise ValueError(f"hold_queue: must be >= 0, got {self.hold_queue}")
        if self.api_key == "":
            raise ValueError("api_key: empty; leave it unset to disable authentication")

    @property
    def prefill_weights(self) -> PrefillWeights:
        return PrefillWeights(prefix=self.prefix_weight, load=self.load_weight, block_size=self.block_size)

    @property
    def roles(self) -> tuple[str, ...]:
        """The pools this mode needs (a request in aggregated mode uses the 'engine' pool)."""
        if self.mode == "aggregated":
            return (contract.ROLE_AGGREGATED,)
        return (contract.ROLE_PREFILL, contract.ROLE_DECODE)
