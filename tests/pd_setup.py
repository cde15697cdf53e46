"""The P/D test set-up shared by the engine-core, HTTP and router tests of KV transfer: the
prompt set, the deployment's signing-key environment, and the engine settings of each role."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from baton_engine import contract
from baton_support.ports import free_port

KEY = "pd-test-deployment-key"
BLOCK_SIZE = 16
MODEL = "builtin:smollm2-135m-instruct"

TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4, 5,",
    "Explain why the sky is blue in one sentence.",
    "def fibonacci(n):",
    "Translate to French: good morning, my friend.",
    "List three primary colors:",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "A recipe for pancakes needs flour, eggs, milk and",
    "In physics, energy is",
    "Hello",
    "Summarize: Kubernetes is a system for automating deployment, scaling and management of "
    "containerized applications. It groups containers into logical units.",
    "The three laws of thermodynamics are",
    "Name a famous painting by Leonardo da Vinci:",
]
# Prompts that share SHARED_PREFIX's full blocks: after a warm-up request on the consumer they
# partly hit its prefix cache, so it pulls only the rest.
SHARED_PREFIX = (
    "You are a helpful assistant. Answer briefly and precisely, and never make things up. "
    "The user is a student preparing for an exam in history and geography. "
)
PREFIXED = ["Question: who built the pyramids?", "Question: what is the longest river?"]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@contextlib.contextmanager
def pd_environment(key: str = KEY) -> Iterator[None]:
    """The deployment's shared signing key set, and no pod IP (engines advertise 127.0.0.1)."""
    mp = pytest.MonkeyPatch()
    mp.setenv(contract.ENV_KV_TRANSFER_KEY, key)
    mp.delenv(contract.ENV_POD_IP, raising=False)
    try:
        yield
    finally:
        mp.undo()


def core_settings(role: str, *, num_kv_blocks: int, lease_seconds: float = 30.0) -> dict[str, Any]:
    """EngineConfig fields of one role's engine core (CPU, float32)."""
    settings: dict[str, Any] = dict(
        dtype="float32", num_kv_blocks=num_kv_blocks, max_model_len=1024, block_size=BLOCK_SIZE
    )
    if role != "none":
        settings.update(kv_role=role, kv_lease_seconds=lease_seconds)
    if role in ("producer", "both"):
        settings["kv_transfer_port"] = free_port()
    return settings


def serve_args(role: str, *, num_kv_blocks: int, lease_seconds: float, name: str) -> tuple[str, ...]:
    """`baton-engine serve` flags of one role's engine (after the model), the same settings."""
    args = [
        "--dtype", "float32", "--served-model-name", name, "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "1024", "--num-kv-blocks", str(num_kv_blocks),
        "--kv-role", role, "--kv-lease-seconds", str(lease_seconds),
    ]  # fmt: skip
    if role in ("producer", "both"):
        args += ["--kv-transfer-port", str(free_port())]
    return tuple(args)
