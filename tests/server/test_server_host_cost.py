"""What the server process does once rather than per request or per token."""

from __future__ import annotations

import asyncio

import uvloop

from baton_engine.config import EngineConfig
from baton_engine.model.loader.tokenizer_loading import load_tokenizer
from baton_engine.server.metrics import EngineMetrics
from baton_engine.server.serve import _event_loop_factory
from baton_engine.server.state import ServerState


def test_token_pieces_are_built_once_per_server_and_only_with_a_tokenizer() -> None:
    config = EngineConfig(model="builtin:smollm2-135m-instruct")
    tokenizer = load_tokenizer(config.model)
    state = ServerState(config=config, metrics=EngineMetrics(""), tokenizer=tokenizer)
    token_text = state.token_text
    assert token_text is not None and state.token_text is token_text  # every request shares it
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    assert [token_text(t) for t in hello] == ["Hello"]
    assert token_text.token_bytes(hello[0]) == list(b"Hello")
    assert ServerState(config=config, metrics=EngineMetrics("")).token_text is None


def test_the_server_runs_on_uvloop() -> None:
    factory = _event_loop_factory()
    assert factory is uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
