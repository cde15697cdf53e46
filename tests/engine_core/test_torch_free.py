"""The engine core is pure Python + numpy: importing it must not load torch."""

from __future__ import annotations

import subprocess
import sys

CORE_MODULES = [
    "baton_engine.sampling_params",
    "baton_engine.sequence",
    "baton_engine.kv_cache_events",
    "baton_engine.prefix_hash",
    "baton_engine.block_manager",
    "baton_engine.batch_state",
    "baton_engine.scheduler_stats",
    "baton_engine.scheduler_output",
    "baton_engine.step_builder",
    "baton_engine.scheduler",
]


def test_core_modules_do_not_import_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {CORE_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
