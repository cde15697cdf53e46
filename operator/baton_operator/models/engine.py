"""Engine settings: one set at `spec.engine`, overridable per role at `spec.<role>.engine`.

Settings that must agree across one deployment's pods (block size, KV dtype, weight quantization,
the prefix hash, the context length, the HTTP port) exist only at the top: a decode pod can only
pull KV blocks laid out like its own, and the router hashes prompts with the engines' block size.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

from pydantic import Field, field_validator, model_validator

from baton_engine import contract
from baton_operator.models.base import CrdModel, cel, validations

DEFAULT_ENGINE_IMAGE = "ghcr.io/baton-llm/baton-engine:0.1.0"

PullPolicy = Literal["Always", "IfNotPresent", "Never"]
Device = Literal["cuda", "cpu"]
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
KvCacheDtype = Literal["auto", "fp8"]
Quantization = Literal["fp8"]
PrefixHash: TypeAlias = contract.PrefixHashName

ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: An image reference: no whitespace (the API server refuses leading and trailing whitespace).
IMAGE_PATTERN = r"^\S+$"
#: Variables the operator sets in every engine container: a user's own would collide with them
#: (the API server refuses an env list with one name twice).
OPERATOR_ENV: tuple[str, ...] = (
    contract.ENV_POD_IP,
    contract.ENV_POD_NAME,
    contract.ENV_POD_NAMESPACE,
    contract.ENV_KV_TRANSFER_KEY,
    "HOME",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
)
_OPERATOR_ENV_CEL = "[" + ", ".join(f"'{name}'" for name in OPERATOR_ENV) + "]"
ENV_RULE = f"the operator sets {', '.join(OPERATOR_ENV)} itself"


class EnvVar(CrdModel):
    """A literal environment variable for the engine container."""

    model_config = {
        "json_schema_extra": validations(
            cel(
                f"!(self.name in {_OPERATOR_ENV_CEL})",
                f"env[].name: {ENV_RULE}",
                ".name",
                "FieldValueForbidden",
            )
        )
    }

    name: str = Field(min_length=1, max_length=128, pattern=ENV_NAME_PATTERN, description="Variable name.")
    value: str = Field("", max_length=4096, description="Literal value.")

    @field_validator("name")
    @classmethod
    def _not_the_operators(cls, name: str) -> str:
        if name in OPERATOR_ENV:
            raise ValueError(f"env[].name: {ENV_RULE}")
        return name


#: The env lists are maps keyed by name: the API server refuses a name given twice.
ENV_LIST_EXTRA: dict[str, Any] = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}


def unique_names(env: list[EnvVar] | None) -> list[EnvVar] | None:
    """`env` if no name is given twice (the API server refuses such a container)."""
    names = [e.name for e in env or []]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"env: {', '.join(duplicates)} given more than once")
    return env


_D: dict[str, str] = {
    "image": "Engine container image (runs `baton-engine serve`).",
    "image_pull_policy": "Image pull policy of the engine container.",
    "device": "Torch device: cuda (ROCm builds of torch also use 'cuda') or cpu.",
    "max_num_seqs": "Most sequences scheduled in one engine step.",
    "max_num_batched_tokens": "Token budget of one engine step (at least blockSize; at least "
    "maxModelLen when chunked prefill is off).",
    "num_kv_blocks": "KV-cache blocks per pod; default: sized from free device memory.",
    "gpu_memory_utilization": "Fraction of device memory an engine may use for weights and KV cache.",
    "prefix_caching": "Reuse KV blocks of identical prompt prefixes.",
    "chunked_prefill": "Split long prompts into chunks and mix them with decodes in one step.",
    "max_queued_requests": "Waiting requests beyond which an engine answers HTTP 429.",
    "tensor_parallel_size": "Ranks one engine pod splits the model across, one GPU each "
    "(`--tensor-parallel-size`); default: the pod's GPU count (1 without GPUs). Must not exceed "
    "resources.gpus; pools of different sizes still pass KV to each other.",
    "extra_args": "Extra `baton-engine serve` flags, appended after the ones Baton renders.",
    "env": "Extra literal environment variables of the engine container.",
}


class EngineOverrides(CrdModel):
    """Per-role engine settings; each one left out inherits `spec.engine`."""

    image: str | None = Field(
        None, min_length=1, max_length=512, pattern=IMAGE_PATTERN, description=_D["image"]
    )
    image_pull_policy: PullPolicy | None = Field(None, description=_D["image_pull_policy"])
    device: Device | None = Field(None, description=_D["device"])
    max_num_seqs: int | None = Field(None, ge=1, le=65536, description=_D["max_num_seqs"])
    max_num_batched_tokens: int | None = Field(
        None, ge=1, le=1048576, description=_D["max_num_batched_tokens"]
    )
    num_kv_blocks: int | None = Field(None, ge=1, le=16777216, description=_D["num_kv_blocks"])
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description=_D["gpu_memory_utilization"]
    )
    prefix_caching: bool | None = Field(None, description=_D["prefix_caching"])
    chunked_prefill: bool | None = Field(None, description=_D["chunked_prefill"])
    max_queued_requests: int | None = Field(None, ge=1, le=1048576, description=_D["max_queued_requests"])
    tensor_parallel_size: int | None = Field(None, ge=1, le=64, description=_D["tensor_parallel_size"])
    extra_args: list[str] | None = Field(None, max_length=32, description=_D["extra_args"])
    env: list[EnvVar] | None = Field(
        None, max_length=64, description=_D["env"], json_schema_extra=ENV_LIST_EXTRA
    )

    @field_validator("env")
    @classmethod
    def _unique_env(cls, env: list[EnvVar] | None) -> list[EnvVar] | None:
        return unique_names(env)


class EngineSpec(CrdModel):
    """Engine settings shared by every engine pod of the deployment."""

    model_config = {
        "json_schema_extra": validations(
            cel(
                "self.maxNumBatchedTokens >= self.blockSize",
                "spec.engine.maxNumBatchedTokens must be >= spec.engine.blockSize",
                ".maxNumBatchedTokens",
                "FieldValueInvalid",
            ),
            cel(
                "self.chunkedPrefill || self.maxNumBatchedTokens >= self.maxModelLen",
                "spec.engine.maxNumBatchedTokens must be >= spec.engine.maxModelLen when chunkedPrefill "
                "is false",
                ".maxNumBatchedTokens",
                "FieldValueInvalid",
            ),
        )
    }

    image: str = Field(
        DEFAULT_ENGINE_IMAGE, min_length=1, max_length=512, pattern=IMAGE_PATTERN, description=_D["image"]
    )
    image_pull_policy: PullPolicy = Field("IfNotPresent", description=_D["image_pull_policy"])
    device: Device = Field("cuda", description=_D["device"])
    dtype: Dtype = Field(
        "auto", description="Weights and KV-cache dtype (shared by all roles: KV blocks move between pods)."
    )
    quantization: Quantization | None = Field(
        None,
        description="Weight quantization (shared by all roles): unset = as the checkpoint is (16-bit, "
        "or FP8 when its config.json says so); fp8 = quantize a 16-bit checkpoint to FP8 on load.",
    )
    kv_cache_dtype: KvCacheDtype = Field(
        "auto",
        description="KV-cache dtype (shared by all roles: KV blocks move between pods): auto = dtype; "
        "fp8 = 8-bit floats with per-layer scales, half the bytes of a 16-bit cache.",
    )
    port: int = Field(
        contract.DEFAULT_HTTP_PORT, ge=1, le=65535, description="Engine HTTP port (named 'http')."
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block (shared by all roles).")
    max_model_len: int = Field(
        4096, ge=1, le=1048576, description="Longest prompt plus output, in tokens (shared by all roles)."
    )
    prefix_hash: PrefixHash = Field(
        "fast",
        description="Prefix-block hash: fast, or vLLM's keys for external KV-event indexers: "
        "vllm-sha256 (vLLM's default) or vllm-sha256-cbor.",
    )
    prefix_hash_seed: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Root seed of the vllm-* prefix hashes (vLLM's PYTHONHASHSEED); default: vLLM's "
        "own default root, as vLLM pods without PYTHONHASHSEED use.",
    )
    max_num_seqs: int = Field(256, ge=1, le=65536, description=_D["max_num_seqs"])
    max_num_batched_tokens: int = Field(2048, ge=1, le=1048576, description=_D["max_num_batched_tokens"])
    num_kv_blocks: int | None = Field(None, ge=1, le=16777216, description=_D["num_kv_blocks"])
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description=_D["gpu_memory_utilization"])
    prefix_caching: bool = Field(True, description=_D["prefix_caching"])
    chunked_prefill: bool = Field(True, description=_D["chunked_prefill"])
    max_queued_requests: int = Field(1024, ge=1, le=1048576, description=_D["max_queued_requests"])
    tensor_parallel_size: int | None = Field(None, ge=1, le=64, description=_D["tensor_parallel_size"])
    extra_args: list[str] = Field(default_factory=list, max_length=32, description=_D["extra_args"])
    env: list[EnvVar] = Field(
        default_factory=list, max_length=64, description=_D["env"], json_schema_extra=ENV_LIST_EXTRA
    )

    @field_validator("env")
    @classmethod
    def _unique_env(cls, env: list[EnvVar]) -> list[EnvVar]:
        return unique_names(env) or []

    @model_validator(mode="after")
    def _budget(self) -> EngineSpec:
        check_budget(self, "spec.engine")
        return self

    def merged(self, overrides: EngineOverrides | None) -> EngineSpec:
        """The effective settings of one role: the top-level ones with its overrides on top."""
        if overrides is None:
            return self
        values: dict[str, Any] = dict(self)
        values.update({k: v for k, v in dict(overrides).items() if v is not None})
        return EngineSpec.model_construct(_fields_set=self.model_fields_set, **values)


def tensor_parallel_size(engine: EngineSpec, gpus: int) -> int:
    """The ranks of a pod running `engine` (a role's merged settings) with `gpus` accelerators."""
    return engine.tensor_parallel_size or max(1, gpus)


def check_tensor_parallel(engine: EngineSpec, gpus: int, role: str) -> None:
    """A pod cannot split its model across more GPUs than it has (CPU pods run any size)."""
    if gpus > 0 and tensor_parallel_size(engine, gpus) > gpus:
        raise ValueError(tensor_parallel_message(role))


def tensor_parallel_message(role: str) -> str:
    return f"spec.{role}.engine.tensorParallelSize must be <= spec.{role}.resources.gpus (one GPU per rank)"


def check_budget(engine: EngineSpec, where: str) -> None:
    """The step budget must hold at least one block, and a whole prompt if prompts are not chunked."""
    if engine.max_num_batched_tokens < engine.block_size:
        raise ValueError(f"{where}.maxNumBatchedTokens must be >= spec.engine.blockSize")
    if not engine.chunked_prefill and engine.max_num_batched_tokens < engine.max_model_len:
        raise ValueError(
            f"{where}.maxNumBatchedTokens must be >= spec.engine.maxModelLen when chunkedPrefill is false"
        )
