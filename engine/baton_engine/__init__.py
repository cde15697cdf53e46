"""Baton's data plane: the paged-KV inference engine, its server, KV events, KV transfer, router.

The offline API: ``from baton_engine import LLM, SamplingParams``. Both are imported on first
use, so that importing the package (the router and the operator's contract do) pulls in
neither torch nor the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from baton_engine.core.sampling_params import SamplingParams
    from baton_engine.entrypoints.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from baton_engine.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from baton_engine.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
