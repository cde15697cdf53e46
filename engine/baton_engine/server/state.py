"""What the HTTP handlers share: the engine client, tokenizer, metrics and lifecycle flags."""

from __future__ import annotations

from dataclasses import dataclass

from baton_engine.config import EngineConfig
from baton_engine.server.engine_client import EngineClient
from baton_engine.server.metrics import EngineMetrics
from baton_engine.text.tokenizer import Tokenizer


@dataclass
class ServerState:
    config: EngineConfig
    metrics: EngineMetrics
    client: EngineClient | None = None
    tokenizer: Tokenizer | None = None
    model_name: str = ""
    max_model_len: int = 0
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    ready: bool = False
    """The model is loaded and the core answered ``ready``."""
    draining: bool = False
    """SIGTERM received: not ready, no new requests, in-flight ones finish."""
    load_error: str | None = None
    in_flight: int = 0
