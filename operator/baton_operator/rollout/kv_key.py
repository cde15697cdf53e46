"""The KV-compatibility key: a digest of exactly the spec fields that change the KV cache.

Two engine pods can hand KV blocks to each other only if their blocks mean the same thing: the
same model weights (source and revision), the same KV dtype, the same block size, the same
parallel layout, the same prefix-block hash. Every engine pod carries the key as the label
`contract.LABEL_KV_COMPAT` and the flag `contract.FLAG_KV_COMPAT_KEY`; the router pairs a
prefill pod only with decode pods of its key, the engines refuse a transfer between keys, and a
change of the key is rolled out decode-first in new generations (`rollout.plan`). Every other
field (images, env, scheduler budgets, resources) rolls each pool in place.

`KEY_FIELDS` and `NOT_KEY_FIELDS` classify every `EngineSpec` field; a test fails when a field
is added to the model without being classified, so a new KV-shaping setting cannot be missed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final

from baton_operator.models import EngineSpec, ModelSpec

#: Bump when the digest's inputs change meaning: every pod then rolls to a new generation.
KEY_SCHEMA: Final = 2  # 2: the tensor-parallel size left the key (P/D works across TP sizes)
KEY_LENGTH: Final = 16  # hex digits: a label value, and 64 bits against accidental collisions

#: EngineSpec fields that shape the KV cache (or how its blocks are named).
KEY_FIELDS: Final[frozenset[str]] = frozenset(
    {
        "dtype",
        "block_size",
        "prefix_hash",
        "prefix_hash_seed",
        "kv_cache_dtype",
        "quantization",
    }
)
#: EngineSpec fields that do not: changing them rolls each pool in place.
NOT_KEY_FIELDS: Final[frozenset[str]] = frozenset(
    {
        "image",
        "image_pull_policy",
        "device",  # only through the dtype "auto" resolves to (see resolved_kv_dtype)
        "port",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "num_kv_blocks",
        "gpu_memory_utilization",
        "prefix_caching",
        "chunked_prefill",
        "max_queued_requests",
        # A consumer pulls each rank's heads from the producer ranks holding them, whatever
        # either side's size (kv_transfer_params carry the layout).
        "tensor_parallel_size",
        "extra_args",
        "env",
    }
)


def resolved_kv_dtype(engine: EngineSpec) -> str:
    """The KV dtype a pod runs with: an explicit KV-cache dtype, else the dtype, with "auto"
    resolved as the engine resolves it (float32 on CPU, bfloat16 on an accelerator)."""
    kv_cache_dtype = getattr(engine, "kv_cache_dtype", None)
    if kv_cache_dtype not in (None, "auto"):
        return str(kv_cache_dtype)
    if engine.dtype != "auto":
        return engine.dtype
    return "float32" if engine.device == "cpu" else "bfloat16"


def key_inputs(model: ModelSpec, engine: EngineSpec) -> dict[str, Any]:
    """What the key digests, as plain JSON values (status and tests show it)."""
    return {
        "schema": KEY_SCHEMA,
        "modelSource": model.source,
        "modelRevision": model.revision or "",
        "kvDtype": resolved_kv_dtype(engine),
        "blockSize": engine.block_size,
        "prefixHash": engine.prefix_hash,
        "prefixHashSeed": engine.prefix_hash_seed or "",
        "quantization": getattr(engine, "quantization", None) or "none",
    }


def kv_compat_key(model: ModelSpec, engine: EngineSpec) -> str:
    """The key of pods running `engine` (a role's merged settings) on `model`: hex digits."""
    canonical = json.dumps(key_inputs(model, engine), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:KEY_LENGTH]
