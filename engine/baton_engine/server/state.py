"""What the HTTP handlers share: the engine client, tokenizer, metrics and lifecycle flags."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from baton_engine.config import EngineConfig
from baton_engine.server.engine_client import EngineClient
from baton_engine.server.metrics import EngineMetrics
from baton_engine.server.openai_format import TokenText
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
    max_token_chars: int = 0
    """Most characters one token of the tokenizer decodes to: a text longer than
    ``max_model_len * max_token_chars`` cannot fit, and is refused without tokenizing it."""
    preprocessor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="preprocess")
    )
    """Parses and tokenizes large bodies off the event loop (one at a time: they are rare)."""
    _token_text: TokenText | None = field(default=None, init=False, repr=False)

    @property
    def token_text(self) -> TokenText | None:
        """The tokenizer's token pieces and bytes (logprobs), built once and shared by every
        request: building it reads the tokenizer's whole JSON (SmolLM2's: 1.5 MB, ~50 ms), which
        per request was 94 % of the server process's CPU under a streaming load."""
        if self._token_text is None and self.tokenizer is not None:
            self._token_text = TokenText(self.tokenizer)
        return self._token_text

    def engine_started(self, client: EngineClient) -> None:
        """Take what the started core told `client` (model, limits, EOS ids, KV blocks); ready."""
        info = client.info
        self.client = client
        self.model_name = self.config.served_model_name or str(info["model_name"])
        self.metrics.set_model_name(self.model_name)
        self.max_model_len = int(info["max_model_len"])
        self.vocab_size = int(info["vocab_size"])
        self.eos_token_ids = tuple(info["eos_token_ids"])
        self.metrics.kv_blocks.labels(self.model_name).set(int(info["num_kv_blocks"]))
        self.ready = True


def max_token_chars(tokenizer: Tokenizer) -> int:
    """The longest text any single token of `tokenizer` decodes to, in characters."""
    decode = tokenizer.decode
    return max((len(decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size)), default=1)
