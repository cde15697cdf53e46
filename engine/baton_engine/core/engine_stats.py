"""A snapshot of the engine core's state for metrics: gauges now, counters since start.

Torch-free and plain data, so the core process can send it to the server process as a dict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class EngineStats:
    """The engine core's metrics snapshot (`EngineCore.stats`; `server.metrics` exposes it)."""

    num_waiting: int = 0
    """Requests queued for (re)admission, including those waiting for remote KV."""
    num_running: int = 0
    """Requests holding a row in the running batch."""
    kv_usage: float = 0.0
    """Fraction of KV blocks referenced by live requests (0..1)."""
    num_kv_blocks: int = 0
    """KV blocks in the pool."""
    num_used_kv_blocks: int = 0
    """KV blocks referenced by live requests (held producer leases included)."""
    prefix_queried_tokens: int = 0
    """Cumulative prompt tokens looked up in the prefix cache."""
    prefix_hit_tokens: int = 0
    """Cumulative prompt tokens served from the prefix cache."""
    num_preemptions: int = 0
    """Cumulative preemptions (recompute)."""
    prompt_tokens: int = 0
    """Cumulative prompt tokens of admitted requests."""
    generation_tokens: int = 0
    """Cumulative generated tokens."""
    spec_draft_tokens: int = 0
    """Cumulative speculative draft tokens proposed (and verified)."""
    spec_accepted_tokens: int = 0
    """Cumulative draft tokens accepted (the bonus/corrected token not counted)."""
    spec_num_drafts: int = 0
    """Verify rows: decode rows that carried at least one draft (cumulative)."""
    spec_accepted_per_position: list[int] = field(default_factory=list)
    """``[j]``: verify rows whose draft ``j`` was accepted (cumulative, length K)."""
    num_steps: int = 0
    """Steps that ran the model (cumulative)."""
    kv_transfer: dict[str, Any] | None = None
    """Cumulative KV-transfer totals (`kv_transfer.metrics.TransferTotals`), when P/D is on."""
    num_grammar_requests: int = 0
    """Requests whose output follows a grammar (structured output) right now."""
    kv_leases_held: int = 0
    """Producer leases not yet ended: prefilled KV a consumer may still pull (a draining server
    waits for these before it stops the core)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EngineStats:
        return cls(**raw)
