"""A short `bench.soak` against the tiny model (the configuration of `python -m bench.soak
--quick`): mixed valid, invalid, cancelled, streaming and structured (JSON-schema) requests leave no KV
block or grammar in use, no request stuck and every answer as expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import quick_config, run_soak

pytestmark = pytest.mark.slow


def test_short_soak_leaks_no_block_and_leaves_no_request_stuck(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = run_soak(quick_config(tiny_model_dir, tmp_path / "server.log"))
    assert result["unexpected"] == []
    assert result["end"] == {
        "num_used_kv_blocks": 0,
        "num_kv_blocks": 512,
        "num_grammar_requests": 0,
        "num_running": 0,
        "num_waiting": 0,
        "in_flight": 0,
        "health": 200,
        "ready": 200,
    }
    assert result["server_exit_code"] == 0
    kinds = set(result["by_kind"])
    assert {"completion", "chat_stream", "dropped_stream", "deadline", "structured"} <= kinds
    assert any(kind.startswith("bad:") for kind in kinds)
