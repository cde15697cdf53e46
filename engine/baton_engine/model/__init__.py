"""The Llama-family decoder over a paged KV cache, and its attention backends."""

from baton_engine.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedArchitectureError
from baton_engine.model.llama import CausalLM, build_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "UnsupportedArchitectureError",
    "build_model",
]
