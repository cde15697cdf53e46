"""The router's KV-event side (subscriber, index, wire format, vLLM keys) never imports torch."""

from __future__ import annotations

import subprocess
import sys

ROUTER_SIDE_MODULES = (
    "baton_engine.kv_events_subscriber",
    "baton_engine.kv_prefix_index",
    "baton_engine.kv_events_wire",
    "baton_engine.prefix_hash_vllm",
    "baton_engine.kv_events_publisher",
)


def test_kv_event_modules_import_without_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in ROUTER_SIDE_MODULES)
        + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
