"""What the data plane and the control plane agree on. Torch-free, stdlib-only.

The operator builds engine pods from these names, the router discovers and scrapes pods with
them, and the engine parses them. Changing a value here changes the wire contract between the
planes; `tests/test_contract.py` checks the shared values, and import-linter (pyproject's
``[tool.importlinter]``) that neither the operator nor the router imports torch.

Sections, by topic: ports; Kubernetes labels, roles and environment; engine flags; router flags;
HTTP paths; engine metric names (speculative decoding included); router metric names; KV events;
kv_transfer_params.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Final, Literal, get_args

# ------------------------------------------------------------------------------------------- ports

#: Named container ports (Kubernetes port names are at most 15 characters) and their defaults.
PORT_HTTP: Final = "http"
PORT_KV_EVENTS: Final = "kv-events"
PORT_KV_EVENTS_REPLAY: Final = "kv-replay"
PORT_KV_TRANSFER: Final = "kv-transfer"
PORT_METRICS: Final = "metrics"  # operator and router expose metrics on their own port

DEFAULT_HTTP_PORT: Final = 8000
DEFAULT_KV_EVENTS_PORT: Final = 5557
DEFAULT_KV_EVENTS_REPLAY_PORT: Final = 5558
DEFAULT_KV_TRANSFER_PORT: Final = 5600
DEFAULT_ROUTER_PORT: Final = 8080
DEFAULT_OPERATOR_METRICS_PORT: Final = 8090

DEFAULT_PORTS: Final[dict[str, int]] = {
    PORT_HTTP: DEFAULT_HTTP_PORT,
    PORT_KV_EVENTS: DEFAULT_KV_EVENTS_PORT,
    PORT_KV_EVENTS_REPLAY: DEFAULT_KV_EVENTS_REPLAY_PORT,
    PORT_KV_TRANSFER: DEFAULT_KV_TRANSFER_PORT,
}


# ---------------------------------------------------------- Kubernetes: labels, roles, environment

LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_ROLE: Final = "baton.dev/role"
LABEL_DEPLOYMENT: Final = "baton.dev/deployment"
APP_NAME: Final = "baton"
MANAGED_BY: Final = "baton-operator"

ROLE_PREFILL: Final = "prefill"
ROLE_DECODE: Final = "decode"
ROLE_AGGREGATED: Final = "engine"  # one pool doing both prefill and decode
ROLE_ROUTER: Final = "router"
ENGINE_ROLES: Final[tuple[str, ...]] = (ROLE_PREFILL, ROLE_DECODE, ROLE_AGGREGATED)

#: The KV-transfer role each engine pool runs with.
KV_ROLE_OF: Final[dict[str, str]] = {
    ROLE_PREFILL: "producer",
    ROLE_DECODE: "consumer",
    ROLE_AGGREGATED: "both",
}


def pod_selector(deployment: str, role: str) -> dict[str, str]:
    """The label selector of one role's pods in one InferenceDeployment."""
    return {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role}


#: On every engine pod (not the router's): what an InferencePool selects.
LABEL_ENGINE: Final = "baton.dev/engine"
#: The role label llm-d's scheduler (its prefill and decode filters) reads, and its values.
LABEL_LLMD_ROLE: Final = "llm-d.ai/role"
LLMD_ROLE_OF: Final[dict[str, str]] = {
    ROLE_PREFILL: "prefill",
    ROLE_DECODE: "decode",
    ROLE_AGGREGATED: "prefill-decode",
}


#: On every engine pod: the KV-compatibility key, a digest of exactly the spec fields that change
#: the KV cache's layout or meaning (model source and revision, KV dtype, block size, tensor
#: parallel layout, prefix-hash settings). The router pairs a prefill pod only with decode pods
#: of the same key; a pod without the label has the key "" (static or pre-key pods).
LABEL_KV_COMPAT: Final = "baton.dev/kv-compat"
#: Engine pod annotations the router reads to hash prompts as that pod does (prefix routing):
#: during a block-size rollout the two generations of pods hash differently.
ANNOTATION_BLOCK_SIZE: Final = "baton.dev/block-size"
ANNOTATION_PREFIX_HASH: Final = "baton.dev/prefix-hash"
#: ... and the root seed of its vllm-* hashes (absent: vLLM's default root).
ANNOTATION_PREFIX_HASH_SEED: Final = "baton.dev/prefix-hash-seed"


def engine_pods_selector(deployment: str) -> dict[str, str]:
    """The label selector of every engine pod (all roles, no router) of one InferenceDeployment."""
    return {LABEL_DEPLOYMENT: deployment, LABEL_ENGINE: "true"}


def engine_pod_labels(deployment: str, role: str) -> dict[str, str]:
    """Labels an engine pod of `role` carries beyond its Deployment's selector."""
    return {**engine_pods_selector(deployment), LABEL_LLMD_ROLE: LLMD_ROLE_OF[role]}


#: HMAC key shared by one deployment's engine pods (the operator fills it from a Secret).
ENV_KV_TRANSFER_KEY: Final = "BATON_KV_TRANSFER_KEY"
#: The address peers use to reach this pod (the operator sets it from status.podIP).
ENV_POD_IP: Final = "BATON_POD_IP"
ENV_POD_NAME: Final = "BATON_POD_NAME"
ENV_POD_NAMESPACE: Final = "BATON_POD_NAMESPACE"
SECRET_KEY_FIELD: Final = "kv-transfer-key"


# ------------------------------------------------------------------------------------ engine flags

#: Engine flags (``baton-engine serve``). The operator renders pod args from these names only.
FLAG_MODEL: Final = "--model"
FLAG_SERVED_MODEL_NAME: Final = "--served-model-name"
FLAG_HOST: Final = "--host"
FLAG_PORT: Final = "--port"
FLAG_DEVICE: Final = "--device"
FLAG_DTYPE: Final = "--dtype"
FLAG_QUANTIZATION: Final = "--quantization"
FLAG_KV_CACHE_DTYPE: Final = "--kv-cache-dtype"
FLAG_TENSOR_PARALLEL_SIZE: Final = "--tensor-parallel-size"
FLAG_BLOCK_SIZE: Final = "--block-size"
FLAG_MAX_NUM_SEQS: Final = "--max-num-seqs"
FLAG_MAX_NUM_BATCHED_TOKENS: Final = "--max-num-batched-tokens"
FLAG_MAX_MODEL_LEN: Final = "--max-model-len"
FLAG_NUM_KV_BLOCKS: Final = "--num-kv-blocks"
FLAG_GPU_MEMORY_UTILIZATION: Final = "--gpu-memory-utilization"
FLAG_PREFIX_CACHING: Final = "--enable-prefix-caching"  # BooleanOptionalAction: --no-enable-...
FLAG_CHUNKED_PREFILL: Final = "--enable-chunked-prefill"  # BooleanOptionalAction
FLAG_MAX_QUEUE: Final = "--max-queued-requests"
FLAG_KV_ROLE: Final = "--kv-role"
FLAG_KV_TRANSFER_PORT: Final = "--kv-transfer-port"
FLAG_KV_LEASE_SECONDS: Final = "--kv-lease-seconds"
FLAG_KV_ON_FAILURE: Final = "--kv-transfer-on-failure"
FLAG_KV_EVENTS: Final = "--kv-events"  # BooleanOptionalAction
FLAG_KV_EVENTS_PORT: Final = "--kv-events-port"
FLAG_KV_EVENTS_REPLAY_PORT: Final = "--kv-events-replay-port"
FLAG_KV_EVENTS_BUFFER_STEPS: Final = "--kv-events-buffer-steps"
FLAG_KV_EVENTS_ENCODING: Final = "--kv-events-encoding"  # "map" (vLLM 0.32) | "array" (v0.22)
FLAG_METRIC_NAMES: Final = "--metric-names"  # "both" | "baton" | "vllm"
FLAG_PREFIX_HASH: Final = "--prefix-hash"  # one of PREFIX_HASHES
FLAG_PREFIX_HASH_SEED: Final = "--prefix-hash-seed"  # root seed of the vllm-* hashes
FLAG_SPECULATIVE: Final = "--speculative"
FLAG_NUM_SPECULATIVE_TOKENS: Final = "--num-speculative-tokens"
FLAG_NGRAM_MIN: Final = "--ngram-min"
FLAG_NGRAM_MAX: Final = "--ngram-max"
#: The KV-compatibility key the operator computed for this pod (see LABEL_KV_COMPAT): it travels
#: signed in kv_transfer_params, and a consumer refuses to pull from a producer with another key.
FLAG_KV_COMPAT_KEY: Final = "--kv-compat-key"

KVRole = Literal["producer", "consumer", "both", "none"]
KV_ROLES: Final[tuple[str, ...]] = ("producer", "consumer", "both", "none")
KVFailurePolicy = Literal["recompute", "fail"]
KV_FAILURE_POLICIES: Final[tuple[str, ...]] = ("recompute", "fail")
SPECULATIVE_METHODS: Final = ("none", "ngram")

#: Prefix-block key algorithms (``--prefix-hash`` of engines and router; `prefix.hashing` builds
#: them): fast (64-bit BLAKE2b, Baton's default), vllm-sha256 (vLLM's default: SHA-256 of a
#: pickle) and vllm-sha256-cbor (SHA-256 of canonical CBOR) — vLLM's keys, for external KV-event
#: indexers and vLLM peers; the vllm-* ones take their root from the same seed everywhere.
PrefixHashName = Literal["fast", "vllm-sha256", "vllm-sha256-cbor"]
PREFIX_HASH_FAST: Final = "fast"
PREFIX_HASH_VLLM_SHA256: Final = "vllm-sha256"
PREFIX_HASH_VLLM: Final = "vllm-sha256-cbor"
PREFIX_HASHES: Final[tuple[str, ...]] = get_args(PrefixHashName)


# ------------------------------------------------------------------------------------ router flags
# The flags the operator renders into router pods (`baton-router ...`). The router implements
# them; discovery watches Pods matching each selector (Ready condition, status.podIP, the named
# container ports above).

FLAG_ROUTER_DISCOVERY: Final = "--discovery"  # "kubernetes" | "static"
DISCOVERY_KUBERNETES: Final = "kubernetes"
DISCOVERY_STATIC: Final = "static"
FLAG_ROUTER_NAMESPACE: Final = "--namespace"  # namespace whose Pods are watched
FLAG_ROUTER_PREFILL_SELECTOR: Final = "--prefill-selector"  # "k=v,k=v" label selector
FLAG_ROUTER_DECODE_SELECTOR: Final = "--decode-selector"
FLAG_ROUTER_ENGINE_SELECTOR: Final = "--engine-selector"  # aggregated mode: one pool doing both
FLAG_ROUTER_MODEL: Final = "--model"  # served model name (what clients send)
FLAG_ROUTER_MODE: Final = "--mode"  # disaggregated | aggregated: which pod roles it routes to
FLAG_ROUTER_TOKENIZER: Final = "--tokenizer"  # model reference or local path holding the tokenizer
FLAG_ROUTER_HOST: Final = "--host"
FLAG_ROUTER_PORT: Final = "--port"
FLAG_ROUTER_BLOCK_SIZE: Final = "--block-size"  # for pods without ANNOTATION_BLOCK_SIZE (static)
FLAG_ROUTER_PREFIX_HASH: Final = "--prefix-hash"  # for pods without ANNOTATION_PREFIX_HASH
FLAG_ROUTER_PREFIX_HASH_SEED: Final = "--prefix-hash-seed"  # the seed of the vllm-* hashes
FLAG_ROUTER_KV_EVENTS: Final = "--kv-events"  # BooleanOptionalAction: subscribe to pods' KV events
#: Requests held at most at once while a needed pool has no ready pod (0: answer 503 at once).
FLAG_ROUTER_HOLD_QUEUE: Final = "--hold-queue"
#: Seconds one request is held at most before it gets 503 with Retry-After.
FLAG_ROUTER_HOLD_TIMEOUT: Final = "--hold-timeout"


def selector_arg(labels: dict[str, str]) -> str:
    """A label selector as a flag value: ``k=v,k=v`` in sorted key order."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def negated(flag: str) -> str:
    """The off form of a BooleanOptionalAction flag: ``--kv-events`` -> ``--no-kv-events``."""
    return "--no-" + flag.removeprefix("--")


# -------------------------------------------------------------------------------------- HTTP paths

PATH_HEALTH: Final = "/health"
PATH_READY: Final = "/ready"
PATH_METRICS: Final = "/metrics"
# Baton extension on producer pods: POST {"kv_transfer_params": <the signed params>} ends that
# lease early (the router calls it when a client goes away between the legs).
PATH_KV_TRANSFER_RELEASE: Final = "/v1/kv_transfer/release"


# ---------------------------------------------------------------------------------- engine metrics

# Names as exposed on /metrics. Counters carry prometheus_client's `_total` suffix; create them
# with the name minus `_total`. Units are base units (seconds, bytes, ratio 0..1).
M_REQUESTS_WAITING: Final = "baton_num_requests_waiting"
M_REQUESTS_RUNNING: Final = "baton_num_requests_running"
M_KV_USAGE: Final = "baton_kv_cache_usage_ratio"
M_KV_BLOCKS_TOTAL: Final = "baton_kv_cache_blocks"
M_PREFIX_QUERIES: Final = "baton_prefix_cache_queries_tokens_total"
M_PREFIX_HITS: Final = "baton_prefix_cache_hits_tokens_total"
M_PREEMPTIONS: Final = "baton_num_preemptions_total"
M_PROMPT_TOKENS: Final = "baton_prompt_tokens_total"
M_GENERATION_TOKENS: Final = "baton_generation_tokens_total"
M_REQUEST_SUCCESS: Final = "baton_request_success_total"
M_TTFT: Final = "baton_time_to_first_token_seconds"
M_ITL: Final = "baton_inter_token_latency_seconds"
M_E2E: Final = "baton_e2e_request_latency_seconds"
M_QUEUE_TIME: Final = "baton_request_queue_time_seconds"
M_KV_TRANSFER_BYTES: Final = "baton_kv_transfer_bytes_total"
M_KV_TRANSFER_SECONDS: Final = "baton_kv_transfer_seconds"
M_KV_TRANSFER_FAILURES: Final = "baton_kv_transfer_failures_total"
M_KV_LEASES_EXPIRED: Final = "baton_kv_transfer_leases_expired_total"
M_SPEC_DRAFT_TOKENS: Final = "baton_spec_decode_draft_tokens_total"
M_SPEC_ACCEPTED_TOKENS: Final = "baton_spec_decode_accepted_tokens_total"
M_SPEC_NUM_DRAFTS: Final = "baton_spec_decode_num_drafts_total"
"""Counter: verify rows (decode rows that carried at least one draft)."""
M_SPEC_ACCEPTED_PER_POSITION: Final = "baton_spec_decode_accepted_tokens_per_pos_total"
"""Counter with label ``position`` (0-based draft index): verify rows whose draft at that
position was accepted. Divided by M_SPEC_NUM_DRAFTS: the per-position acceptance."""
M_SPEC_ACCEPTANCE_RATE: Final = "baton_spec_decode_acceptance_rate"
"""Gauge: accepted / proposed draft tokens since start (0..1)."""
M_SPEC_TOKENS_PER_FORWARD: Final = "baton_spec_decode_mean_tokens_per_forward"
"""Gauge: mean tokens a verify row gained per forward since start (accepted drafts + 1)."""

#: Baton's engine metric -> the vLLM metric with the same meaning.
VLLM_EQUIVALENT: Final[dict[str, str]] = {
    M_REQUESTS_WAITING: "vllm:num_requests_waiting",
    M_REQUESTS_RUNNING: "vllm:num_requests_running",
    M_KV_USAGE: "vllm:kv_cache_usage_perc",
    M_PREFIX_QUERIES: "vllm:prefix_cache_queries_total",
    M_PREFIX_HITS: "vllm:prefix_cache_hits_total",
    M_PREEMPTIONS: "vllm:num_preemptions_total",
    M_PROMPT_TOKENS: "vllm:prompt_tokens_total",
    M_GENERATION_TOKENS: "vllm:generation_tokens_total",
    M_REQUEST_SUCCESS: "vllm:request_success_total",
    M_TTFT: "vllm:time_to_first_token_seconds",
    M_ITL: "vllm:inter_token_latency_seconds",
    M_E2E: "vllm:e2e_request_latency_seconds",
    M_QUEUE_TIME: "vllm:request_queue_time_seconds",
    M_SPEC_DRAFT_TOKENS: "vllm:spec_decode_num_draft_tokens_total",
    M_SPEC_ACCEPTED_TOKENS: "vllm:spec_decode_num_accepted_tokens_total",
    M_SPEC_NUM_DRAFTS: "vllm:spec_decode_num_drafts_total",
    M_SPEC_ACCEPTED_PER_POSITION: "vllm:spec_decode_num_accepted_tokens_per_pos_total",
}

#: vLLM's gauge whose labels carry the cache layout (value 1); Baton exports it with the labels
#: vLLM readers use (`block_size`, `num_gpu_blocks`).
VM_CACHE_CONFIG: Final = "vllm:cache_config_info"
LABEL_VLLM_MODEL: Final = "model_name"  # the served model name, on every series (as vLLM)

#: The load figures the control plane reads from an engine pod (the router's load tracker, the
#: autoscaler), each under (Baton's name, vLLM's name): a vLLM pod exports only the second, a
#: Baton pod both (same value: read one, never sum them) or either alone.
LOAD_METRICS: Final[dict[str, tuple[str, str]]] = {
    name: (baton, VLLM_EQUIVALENT[baton])
    for name, baton in (
        ("waiting", M_REQUESTS_WAITING),
        ("running", M_REQUESTS_RUNNING),
        ("kv_usage", M_KV_USAGE),
        ("preemptions", M_PREEMPTIONS),
    )
}


# ---------------------------------------------------------------------------------- router metrics
# Exposed by baton-router on its /metrics (prefix baton_router_). Counters carry the `_total`
# suffix as exposed; create them with the name minus `_total`.

#: Client requests by outcome (label "outcome": success, client_error, upstream_error,
#: unavailable, unauthorized, cancelled, internal_error) and mode (label "mode": disaggregated,
#: aggregated).
M_ROUTER_REQUESTS: Final = "baton_router_requests_total"
#: Duration of each upstream leg in seconds (label "leg": prefill, decode, direct): prefill is
#: the whole prefill call; decode and direct run until the last byte reached the client.
M_ROUTER_LEG_SECONDS: Final = "baton_router_leg_duration_seconds"
#: Seconds from the client request arriving to the first response byte sent back.
M_ROUTER_TTFB_SECONDS: Final = "baton_router_time_to_first_byte_seconds"
#: Requests sent whole to a decode pod because the prefill leg failed (label "reason":
#: connect, timeout, status, bad_response, no_prefill_pod, no_paired_prefill (no prefill pod of a
#: decode pod's KV-compatibility key), no_paired_decode (the prefill pod's key lost its last
#: decode pod between the legs)).
M_ROUTER_FALLBACKS: Final = "baton_router_fallbacks_total"
#: Cached prompt tokens on the pods chosen (matched blocks x block size), summed over requests.
M_ROUTER_PREFIX_HIT_TOKENS: Final = "baton_router_prefix_hit_tokens_total"
#: Endpoints currently known by role (label "role").
M_ROUTER_ENDPOINTS: Final = "baton_router_endpoints"
#: Per pod (label "pod"): the next KV-event batch the router expects; every earlier one is applied.
M_ROUTER_KV_EVENTS_NEXT_SEQ: Final = "baton_router_kv_events_next_sequence"
#: Per pod (label "pod"): KV-event batches that did not decode (each drops that pod's index).
M_ROUTER_KV_EVENTS_REJECTED: Final = "baton_router_kv_events_rejected_batches_total"
#: Requests the router holds right now because a pool they need has no ready pod (scaled to zero,
#: or starting): the operator's autoscaler reads this to wake the pools at once.
M_ROUTER_HELD: Final = "baton_router_requests_held"
#: Held requests by how their wait ended (label "outcome": released, timeout, rejected (queue
#: full), cancelled (client gone)).
M_ROUTER_HELD_TOTAL: Final = "baton_router_held_requests_total"
#: Seconds held requests waited for a pod (released ones only).
M_ROUTER_HOLD_SECONDS: Final = "baton_router_hold_duration_seconds"


# --------------------------------------------------------------------------------------- KV events

KV_EVENTS_TOPIC_PREFIX: Final = "kv"


def kv_events_topic(pod_address: str, model_name: str) -> str:
    """The ZMQ topic indexers parse: ``kv@<pod address>@<model name>``."""
    return f"{KV_EVENTS_TOPIC_PREFIX}@{pod_address}@{model_name}"


# ------------------------------------------------------------------------------ kv_transfer_params

KV_TRANSFER_SCHEMA_VERSION: Final = 1
KV_LAYOUT: Final = "layers,kv,blocks,block_size,kv_heads,head_dim"


class KVTransferParamsError(ValueError):
    """kv_transfer_params failed validation or its signature check."""


@dataclass(frozen=True)
class KVTransferParams:
    """What a producer returns for a prefilled request and a consumer pulls from.

    Serialised as the JSON object ``kv_transfer_params`` in the producer's response and in the
    consumer's request. ``signature`` is HMAC-SHA256 (hex) over the canonical JSON of every other
    field, keyed with the deployment's shared key.
    """

    engine_id: str  # the producer engine's unique id (changes on restart)
    host: str  # producer address reachable by the consumer
    port: int  # producer's KV-transfer port
    transfer_id: str  # one prefilled request's lease
    block_ids: list[int]  # producer block ids holding the prompt's KV, in order
    num_tokens: int  # prompt tokens whose KV the blocks hold
    first_token: int  # token the producer sampled after the prompt
    block_size: int  # tokens per block (must equal the consumer's)
    dtype: str  # torch dtype name of the KV cache, e.g. "float32", "bfloat16"
    layout: str = KV_LAYOUT  # the KV cache tensor's dimension order (KV_LAYOUT)
    model: str = ""  # served model name
    lease_expires_at: float = 0.0  # producer wall-clock (unix seconds)
    version: int = KV_TRANSFER_SCHEMA_VERSION  # this schema's version (KV_TRANSFER_SCHEMA_VERSION)
    #: The producer's KV-compatibility key (LABEL_KV_COMPAT); "" when it was started without one.
    kv_key: str = ""
    #: The producer's tensor-parallel layout: its rank r holds the KV heads
    #: ``model.parallel.kv_head_shard(num_kv_heads, tp_size, r)`` and serves them on
    #: ``rank_ports[r]`` (one rank: ``port`` alone, every head). ``num_kv_heads`` is the model's
    #: total (0 in params from before the layout existed: one rank).
    tp_size: int = 1
    rank_ports: list[int] = field(default_factory=list)
    num_kv_heads: int = 0
    signature: str = field(default="", compare=False)  # HMAC-SHA256 hex over the other fields

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def payload(self) -> bytes:
        # Fields at their defaults that came after the first schema (kv_key, the layout) are
        # left out, so params signed before they existed still verify.
        body = {
            k: v
            for k, v in asdict(self).items()
            if k != "signature" and not (k in _LATER_FIELDS and v == _LATER_FIELDS[k])
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def signed(self, key: bytes) -> KVTransferParams:
        sig = hmac.new(key, self.payload(), hashlib.sha256).hexdigest()
        return KVTransferParams(**{**asdict(self), "signature": sig})

    def verify(self, key: bytes) -> None:
        """Raise KVTransferParamsError unless signed with ``key``."""
        if not self.signature:
            raise KVTransferParamsError("kv_transfer_params.signature: missing (unsigned params)")
        want = hmac.new(key, self.payload(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, self.signature):
            raise KVTransferParamsError("kv_transfer_params.signature: does not match (forged or wrong key)")

    @classmethod
    def from_dict(cls, raw: Any) -> KVTransferParams:
        """Validate the JSON shape; errors name the offending field."""
        if not isinstance(raw, dict):
            raise KVTransferParamsError("kv_transfer_params: must be an object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise KVTransferParamsError(f"kv_transfer_params.{unknown[0]}: unknown field")
        types: dict[str, tuple[type, ...]] = {
            "engine_id": (str,),
            "host": (str,),
            "port": (int,),
            "transfer_id": (str,),
            "block_ids": (list,),
            "num_tokens": (int,),
            "first_token": (int,),
            "block_size": (int,),
            "dtype": (str,),
            "layout": (str,),
            "model": (str,),
            "lease_expires_at": (int, float),
            "version": (int,),
            "kv_key": (str,),
            "tp_size": (int,),
            "rank_ports": (list,),
            "num_kv_heads": (int,),
            "signature": (str,),
        }
        required = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
        for name in required:
            if name not in raw:
                raise KVTransferParamsError(f"kv_transfer_params.{name}: required")
        for name, value in raw.items():
            if isinstance(value, bool) or not isinstance(value, types[name]):
                raise KVTransferParamsError(f"kv_transfer_params.{name}: wrong type {type(value).__name__}")
        ids = raw["block_ids"]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
            raise KVTransferParamsError("kv_transfer_params.block_ids: must be non-negative integers")
        if not 0 < raw["port"] < 65536:
            raise KVTransferParamsError("kv_transfer_params.port: out of range")
        if raw["block_size"] <= 0:
            raise KVTransferParamsError("kv_transfer_params.block_size: must be positive")
        if raw["num_tokens"] <= 0 or raw["num_tokens"] > len(ids) * raw["block_size"]:
            raise KVTransferParamsError("kv_transfer_params.num_tokens: inconsistent with block_ids")
        if raw.get("version", KV_TRANSFER_SCHEMA_VERSION) != KV_TRANSFER_SCHEMA_VERSION:
            raise KVTransferParamsError("kv_transfer_params.version: unsupported")
        tp_size = raw.get("tp_size", 1)
        if not 1 <= tp_size <= 64:
            raise KVTransferParamsError("kv_transfer_params.tp_size: must be in [1, 64]")
        ports = raw.get("rank_ports", [])
        if len(ports) != (tp_size if tp_size > 1 else 0):
            raise KVTransferParamsError(
                f"kv_transfer_params.rank_ports: {len(ports)} ports for tp_size {tp_size} "
                "(one per rank when tp_size > 1, none otherwise)"
            )
        if not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports):
            raise KVTransferParamsError("kv_transfer_params.rank_ports: must be integers in [1, 65535]")
        if raw.get("num_kv_heads", 0) < 0 or (tp_size > 1 and raw.get("num_kv_heads", 0) == 0):
            raise KVTransferParamsError("kv_transfer_params.num_kv_heads: must be > 0 when tp_size > 1")
        return cls(**raw)


_LATER_FIELDS: dict[str, Any] = {"kv_key": "", "tp_size": 1, "rank_ports": [], "num_kv_heads": 0}


def sign_dict(params: dict[str, Any], key: bytes) -> dict[str, Any]:
    return KVTransferParams.from_dict(params).signed(key).to_dict()


def verify_dict(params: Any, key: bytes) -> KVTransferParams:
    """Schema check, then signature check; the consumer calls this before any connection."""
    parsed = KVTransferParams.from_dict(params)
    parsed.verify(key)
    return parsed
