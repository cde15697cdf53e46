"""The engine's configuration: one typed place. Field descriptions become `--help` text.

Each field maps to a kebab-case flag of ``baton-engine serve`` (``max_num_seqs`` ->
``--max-num-seqs``); the flags the operator renders are named in `baton_engine.contract`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from baton_engine import contract


class EngineConfig(BaseModel):
    """Settings of one engine process (scheduler, cache, model, server, P/D)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # -- model
    model: str = Field(
        "builtin:smollm2-135m-instruct",
        description="Model reference: builtin:smollm2-135m-instruct, a local directory or GGUF file, "
        "or hf:org/name (resolved from the local Hugging Face cache).",
    )
    served_model_name: str | None = Field(
        None, description="Name clients use in the `model` field; defaults to the model's own name."
    )
    device: str = Field("cpu", description="Torch device: cpu, cuda, cuda:1 (ROCm torch also uses 'cuda').")
    dtype: Literal["float32", "float16", "bfloat16", "float64", "auto"] = Field(
        "auto", description="Weights and KV-cache dtype; auto = float32 on CPU, bfloat16 on GPU."
    )
    seed: int = Field(0, description="Seed of the engine's generator for unseeded sampling.")
    quantization: Literal["fp8"] | None = Field(
        None,
        description="Weight quantization: unset = as the checkpoint is (16-bit, or FP8 when its "
        "config.json has an fp8 or compressed-tensors quantization_config); fp8 = quantize a 16-bit "
        "checkpoint's linear layers and experts to FP8 on load (one scale per output channel, "
        "activations quantized per token).",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="KV-cache dtype: auto = the model dtype; fp8 = 8-bit floats (e4m3fn; e4m3fnuz "
        "on MI300), half the bytes of a 16-bit cache, with one K and one V scale per layer (the "
        "checkpoint's k_scale/v_scale, else 1.0).",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Ranks (GPUs, or CPU processes) one engine's model is split across, Megatron-style: "
        "one process per rank, each loading only its shard; must divide the attention heads, and divide "
        "or be a multiple of the KV heads.",
    )
    tensor_parallel_timeout_seconds: float = Field(
        15.0,
        gt=0,
        description="A tensor-parallel rank silent this long (no heartbeat) is taken as hung and the "
        "engine exits (a rank that dies ends it at once).",
    )

    # -- CPU
    cpu_threads: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Intra-op (torch/OpenMP) threads of the engine core on CPU; default: "
        "OMP_NUM_THREADS if set, else one per CPU the core runs on (the affinity mask, or the "
        "cgroup CPU quota where that is narrower; see --cpu-bind). The offline LLM sets its "
        "process's torch threads to it when given, and otherwise keeps torch's own count.",
    )
    cpu_adaptive_threads: bool = Field(
        True,
        description="On CPU, run each decode step of at most 8 tokens on one intra-op thread or on "
        "all of them, whichever the engine measures faster on this host (each step size tries both, "
        "then re-checks one step in 16); larger steps always use every thread. Off: every step uses "
        "every thread.",
    )
    cpu_bind: Literal["none", "split"] = Field(
        "none",
        description="CPU pinning of a served engine on CPU: none = nothing pinned, the core on every "
        "usable CPU; split = when the process owns its CPUs (no cgroup quota narrower than its "
        "affinity mask) and has 2 or more, the HTTP server on the first and the engine core on the "
        "others, one thread each (vLLM-CPU's default layout: robust to a busy neighbour, but the "
        "server's CPU is lost to compute).",
    )

    # -- cache
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV-cache blocks; default: sized from free memory (GPU) or 4 GiB (CPU)."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Fraction of device memory the engine may use (weights + KV)."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")
    prefix_hash: contract.PrefixHashName = Field(
        "fast",
        description="Prefix-block hash: fast (default), or vLLM's keys so that indexers computing "
        "vLLM keys from prompts find Baton's blocks: vllm-sha256 (vLLM's default algorithm, sha256) "
        "or vllm-sha256-cbor (its sha256_cbor).",
    )
    prefix_hash_seed: str | None = Field(
        None,
        description="Root seed of the vllm-* prefix hashes; default: PYTHONHASHSEED if set, else "
        "vLLM's own default (vllm-none-hash).",
    )

    # -- scheduler
    max_num_seqs: int = Field(
        256, ge=1, description="Most requests at once: running, plus P/D consumers holding KV blocks."
    )
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one step.")
    max_model_len: int = Field(
        4096, ge=1, description="Longest prompt + output, in tokens (capped by the model's own limit)."
    )
    enable_chunked_prefill: bool = Field(
        True, description="Split long prompts into chunks and mix them with decodes in one step."
    )
    scheduler_delay_factor: float = Field(
        0.0,
        ge=0.0,
        description="Delay admitting new prompts until this factor times the last step's latency has "
        "passed since the last prompt was scheduled (batches arrivals; 0 = off).",
    )
    max_queued_requests: int = Field(
        1024, ge=1, description="Waiting requests beyond which new requests get HTTP 429."
    )

    # -- speculative decoding
    speculative: Literal["none", "ngram"] = Field("none", description="Draft method.")
    num_speculative_tokens: int = Field(0, ge=0, le=16, description="Draft tokens per step (K).")
    ngram_min: int = Field(1, ge=1, description="Shortest n-gram matched for prompt-lookup drafts.")
    ngram_max: int = Field(4, ge=1, description="Longest n-gram matched for prompt-lookup drafts.")

    # -- server
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(contract.DEFAULT_HTTP_PORT, ge=1, le=65535, description="HTTP port.")
    max_request_body_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description="Largest HTTP request body accepted; larger ones get HTTP 413 before they are read.",
    )

    # -- P/D and KV events
    kv_role: Literal["producer", "consumer", "both", "none"] = Field(
        "none",
        description="KV-transfer role: producer (prefill pod), consumer (decode pod), both, or none.",
    )
    kv_transfer_port: int = Field(
        contract.DEFAULT_KV_TRANSFER_PORT, ge=1, le=65535, description="Port producers serve pulls on."
    )
    kv_lease_seconds: float = Field(
        30.0, gt=0, description="How long a producer holds a prefilled request's blocks for a pull."
    )
    kv_transfer_on_failure: Literal["recompute", "fail"] = Field(
        "recompute", description="When a pull fails: recompute the prefill locally, or fail the request."
    )
    kv_compat_key: str = Field(
        "",
        max_length=63,
        description="KV-compatibility key (the operator's digest of the settings that shape the KV "
        "cache): a consumer pulls only from producers with the same key, and recomputes otherwise.",
    )
    kv_events: bool = Field(False, description="Publish KV-cache events (vLLM wire format) over ZMQ.")
    kv_events_port: int = Field(contract.DEFAULT_KV_EVENTS_PORT, ge=1, le=65535, description="PUB port.")
    kv_events_replay_port: int = Field(
        contract.DEFAULT_KV_EVENTS_REPLAY_PORT, ge=1, le=65535, description="ROUTER replay port."
    )
    kv_events_buffer_steps: int = Field(10000, ge=1, description="Event batches kept for replay.")
    kv_events_hwm: int = Field(100000, ge=1, description="ZMQ send high-water mark of the PUB socket.")
    metric_names: Literal["both", "baton", "vllm"] = Field(
        "both",
        description="Metric names on /metrics: both (Baton's baton_* and vLLM's vllm:* for the same "
        "figures, e.g. for llm-d's endpoint picker, KEDA rules and vLLM dashboards), baton or vllm.",
    )
    kv_events_encoding: Literal["map", "array"] = Field(
        "map",
        description="KV-event encoding: map (vLLM 0.32's; replays carry the topic) or array (vLLM "
        "v0.22's, for indexers of that time).",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must be <= ngram_max")
        if self.speculative == "ngram" and self.num_speculative_tokens == 0:
            raise ValueError("--speculative ngram needs --num-speculative-tokens >= 1")
        return self
