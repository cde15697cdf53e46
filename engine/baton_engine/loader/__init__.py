"""Model references -> files (`resolve_model`, torch-free) and files -> a ready model (`load_model`).

Importing this package does not import torch: the router resolves references and reads
tokenizers through it. `load_model` and `LoadedModel` (which need torch) are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from baton_engine.loader.reference import ModelNotFoundError, ResolvedModel, resolve_model

if TYPE_CHECKING:
    from baton_engine.loader.model_loading import LoadedModel, load_model

__all__ = ["LoadedModel", "ModelNotFoundError", "ResolvedModel", "load_model", "resolve_model"]

_TORCH_NAMES = ("LoadedModel", "load_model")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from baton_engine.loader import model_loading

        return getattr(model_loading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
