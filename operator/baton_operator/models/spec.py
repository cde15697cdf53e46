"""`InferenceDeployment.spec`: the model, the mode, engine settings, roles, router, KV plumbing."""

from __future__ import annotations

from itertools import combinations
from typing import Literal

from pydantic import Field, model_validator

from baton_engine import contract
from baton_operator.models.autoscaling import AutoscalingSpec
from baton_operator.models.base import CrdModel, cel, object_default, validations
from baton_operator.models.engine import (
    EngineSpec,
    check_budget,
    check_tensor_parallel,
    tensor_parallel_message,
    tensor_parallel_size,
)
from baton_operator.models.inference_pool import InferencePoolSettings
from baton_operator.models.pods import Quantity, RoleSpec, RouterSpec, _quantity
from baton_operator.models.scheduling import DNS_SUBDOMAIN_PATTERN
from baton_operator.models.source import MAX_CLAIM, PARENT_SEGMENT, SOURCE_PATTERN, parse_source

Mode = Literal["disaggregated", "aggregated"]
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"
#: A key of a Secret's data (what the API server calls a config key).
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


class SecretKeyRef(CrdModel):
    """A key of a Secret in the resource's namespace."""

    name: str = Field(
        max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Secret name (a DNS subdomain)."
    )
    key: str = Field(
        "token",
        min_length=1,
        max_length=253,
        pattern=SECRET_KEY_PATTERN,
        description="Key inside the Secret (alphanumerics, '-', '_', '.').",
    )


class ModelSpec(CrdModel):
    """The model served and where its weights come from."""

    model_config = {
        "json_schema_extra": validations(
            cel(
                f"!self.source.matches('{PARENT_SEGMENT}')",
                "spec.model.source must not contain '..' path segments",
                ".source",
            ),
            cel(
                "!self.source.startsWith('pvc://') || "
                f"self.source.substring(6).split('/')[0].size() <= {MAX_CLAIM}",
                f"spec.model.source: the claim name must be at most {MAX_CLAIM} characters",
                ".source",
            ),
            cel(
                "!has(self.hfTokenSecret) || self.source.startsWith('hf:')",
                "spec.model.hfTokenSecret is only allowed with an hf: source",
                ".hfTokenSecret",
            ),
            cel(
                "!has(self.revision) || self.source.startsWith('hf:')",
                "spec.model.revision is only allowed with an hf: source",
                ".revision",
            ),
        )
    }

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=MODEL_NAME_PATTERN,
        description="Served model name: what clients put in the `model` field.",
    )
    source: str = Field(
        max_length=512,
        pattern=SOURCE_PATTERN,
        description="builtin:NAME (inside the engine image), pvc://CLAIM/PATH (mounted read-only) or "
        "hf:ORG/NAME (downloaded by an init container).",
    )
    revision: str | None = Field(
        None, min_length=1, max_length=128, description="hf: branch, tag or commit to download."
    )
    hf_token_secret: SecretKeyRef | None = Field(
        None, description="hf: Secret holding a Hugging Face token (for gated or private models)."
    )
    cache_size: Quantity | None = _quantity(None, "hf: size limit of the download cache volume.")

    @model_validator(mode="after")
    def _source(self) -> ModelSpec:
        source = parse_source(self.source)
        if self.hf_token_secret is not None and source.kind != "hf":
            raise ValueError("spec.model.hfTokenSecret is only allowed with an hf: source")
        if self.revision is not None and source.kind != "hf":
            raise ValueError("spec.model.revision is only allowed with an hf: source")
        return self


class KVTransferSpec(CrdModel):
    """KV-cache transfer from prefill (producer) to decode (consumer) pods."""

    port: int = Field(
        contract.DEFAULT_KV_TRANSFER_PORT,
        ge=1,
        le=65535,
        description="Producer pull port ('kv-transfer'): rank r of a tensor-parallel producer pod serves "
        "its KV heads on port + r ('kv-transfer-r'), so the range port .. port + tensorParallelSize - 1 "
        "must hold no other port of the pod.",
    )
    lease_seconds: int = Field(
        30, ge=1, le=3600, description="How long a producer holds prefilled blocks for the consumer's pull."
    )
    on_failure: Literal["recompute", "fail"] = Field(
        "recompute", description="When a pull fails: recompute the prefill on the decode pod, or fail."
    )


class KVEventsSpec(CrdModel):
    """KV-cache events (vLLM's wire format) the router indexes for prefix-aware routing."""

    enabled: bool = Field(True, description="Publish KV-cache events from every engine pod.")
    port: int = Field(
        contract.DEFAULT_KV_EVENTS_PORT, ge=1, le=65535, description="ZMQ PUB port ('kv-events')."
    )
    replay_port: int = Field(
        contract.DEFAULT_KV_EVENTS_REPLAY_PORT, ge=1, le=65535, description="ZMQ replay port ('kv-replay')."
    )
    buffer_steps: int = Field(10000, ge=1, le=1000000, description="Event batches kept for replay.")
    encoding: Literal["map", "array"] = Field(
        "map",
        description="Event encoding: map (vLLM 0.32's, replays carry the topic) or array (vLLM v0.22's, for "
        "indexers of that time such as llm-d-kv-cache v0.8).",
    )


class NetworkPolicySpec(CrdModel):
    """NetworkPolicies around the engine pods."""

    enabled: bool = Field(
        True,
        description="Engine pods accept traffic only from the router, their own deployment's pods, the "
        "operator and the monitoring namespace.",
    )


#: (YAML path under spec, CEL expression) of every port one engine pod opens.
ENGINE_PORTS: tuple[tuple[str, str], ...] = (
    ("engine.port", "self.engine.port"),
    ("kvTransfer.port", "self.kvTransfer.port"),
    ("kvEvents.port", "self.kvEvents.port"),
    ("kvEvents.replayPort", "self.kvEvents.replayPort"),
)
ROLE_FIELDS: dict[str, str] = {"prefill": "prefill", "decode": "decode", "pool": "pool"}


def _port_rules() -> list[dict[str, str]]:
    return [
        cel(
            f"{a_expr} != {b_expr}",
            f"spec.{b} must differ from spec.{a} (one engine pod opens both)",
            f".{b}",
            "FieldValueInvalid",
        )
        for (a, a_expr), (b, b_expr) in combinations(ENGINE_PORTS, 2)
    ]


#: The roles whose pods serve KV pulls (one port per tensor-parallel rank), with their mode.
PRODUCER_ROLES: dict[str, str] = {"prefill": "disaggregated", "pool": "aggregated"}
#: The ports an engine pod opens besides its KV-transfer range.
OTHER_ENGINE_PORTS = ENGINE_PORTS[:1] + ENGINE_PORTS[2:]


def kv_transfer_range_message(role: str, other: str | None) -> str:
    """Why a producer's KV-transfer port range is refused: it holds port `other` (a path under
    spec), or (None) it runs past the last TCP port."""
    span = f"spec.kvTransfer.port .. spec.kvTransfer.port + spec.{role}.engine.tensorParallelSize - 1"
    if other is None:
        return f"{span} must end at or below 65535 (the {role} pods' ranks serve KV on one port each)"
    return f"spec.{other} must be outside {span} (the {role} pods' ranks serve KV on one port each)"


def kv_transfer_range_errors(kv_port: int, tp: int, others: dict[str, int], role: str) -> list[str]:
    """The refusals of a producer pod's KV-transfer ports ``kv_port .. kv_port + tp - 1``
    against the pod's `others` ports (path under spec -> port); the base port itself equal to
    another is the pairwise rule's to report."""
    errors = [
        kv_transfer_range_message(role, name)
        for name, port in others.items()
        if kv_port < port < kv_port + tp
    ]
    if kv_port + tp - 1 > 65535:
        errors.append(kv_transfer_range_message(role, None))
    return errors


def _role_tensor_parallel_cel(role: str) -> tuple[str, str]:
    """CEL of (the role's GPUs, its pods' tensor-parallel size): the role's tensorParallelSize,
    else the top-level one, else its GPU count (at least 1); a role left out has one GPU."""
    r = f"self.{role}"
    gpus = f"((has({r}) && has({r}.resources) && has({r}.resources.gpus)) ? {r}.resources.gpus : 1)"
    own = f"{r}.engine.tensorParallelSize"
    top = (
        f"(has(self.engine.tensorParallelSize) ? self.engine.tensorParallelSize : ({gpus} > 1 ? {gpus} : 1))"
    )
    return gpus, f"((has({r}) && has({r}.engine) && has({own})) ? {own} : {top})"


def _kv_transfer_range_rules(role: str) -> list[dict[str, str]]:
    _, tp = _role_tensor_parallel_cel(role)
    mode = f"self.mode != '{PRODUCER_ROLES[role]}' ||"
    kv = "self.kvTransfer.port"
    rules = [
        cel(
            f"{mode} {expr} <= {kv} || {expr} >= {kv} + {tp}",
            kv_transfer_range_message(role, name),
            f".{name}",
            "FieldValueInvalid",
        )
        for name, expr in OTHER_ENGINE_PORTS
    ]
    rules.append(
        cel(
            f"{mode} {kv} + {tp} - 1 <= 65535",
            kv_transfer_range_message(role, None),
            ".kvTransfer.port",
            "FieldValueInvalid",
        )
    )
    return rules


def _override_rules(role: str) -> list[dict[str, str]]:
    over = f"self.{role}.engine"
    mnbt = f"(has({over}.maxNumBatchedTokens) ? {over}.maxNumBatchedTokens : self.engine.maxNumBatchedTokens)"
    chunked = f"(has({over}.chunkedPrefill) ? {over}.chunkedPrefill : self.engine.chunkedPrefill)"
    guard = f"!has(self.{role}) || !has(self.{role}.engine) ||"
    return [
        cel(
            f"{guard} {mnbt} >= self.engine.blockSize",
            f"spec.{role}.engine.maxNumBatchedTokens must be >= spec.engine.blockSize",
            f".{role}.engine.maxNumBatchedTokens",
            "FieldValueInvalid",
        ),
        cel(
            f"{guard} {chunked} || {mnbt} >= self.engine.maxModelLen",
            f"spec.{role}.engine.maxNumBatchedTokens must be >= spec.engine.maxModelLen when chunkedPrefill "
            "is false",
            f".{role}.engine.maxNumBatchedTokens",
            "FieldValueInvalid",
        ),
    ]


#: The mode each role field belongs to.
ROLE_MODES: dict[str, str] = {"prefill": "disaggregated", "decode": "disaggregated", "pool": "aggregated"}


def _tensor_parallel_rule(role: str) -> dict[str, str]:
    """A pod's ranks fit its GPUs: the role's tensorParallelSize, else the top-level one, else
    the GPU count (always fits); a role left out has one GPU. CPU pods (0 GPUs) run any size."""
    gpus, tp = _role_tensor_parallel_cel(role)
    return cel(
        f"self.mode != '{ROLE_MODES[role]}' || {gpus} == 0 || {tp} <= {gpus}",
        tensor_parallel_message(role),
        f".{role}.engine.tensorParallelSize",
        "FieldValueInvalid",
    )


SPEC_RULES: list[dict[str, str]] = [
    cel(
        "self.mode != 'aggregated' || !has(self.prefill)",
        "spec.prefill must be empty when spec.mode is aggregated (configure spec.pool)",
        ".prefill",
        "FieldValueForbidden",
    ),
    cel(
        "self.mode != 'aggregated' || !has(self.decode)",
        "spec.decode must be empty when spec.mode is aggregated (configure spec.pool)",
        ".decode",
        "FieldValueForbidden",
    ),
    cel(
        "self.mode != 'disaggregated' || !has(self.pool)",
        "spec.pool must be empty when spec.mode is disaggregated (configure spec.prefill and spec.decode)",
        ".pool",
        "FieldValueForbidden",
    ),
    cel("self.mode == oldSelf.mode", "spec.mode is immutable", ".mode"),
    cel(
        "self.mode != 'disaggregated' || "
        "(self.autoscaling.prefill.minReplicas == 0) == (self.autoscaling.decode.minReplicas == 0)",
        "spec.autoscaling.prefill.minReplicas and spec.autoscaling.decode.minReplicas must be 0 together "
        "(both pools scale to zero together) or both at least 1",
        ".autoscaling.decode.minReplicas",
        "FieldValueInvalid",
    ),
    *_port_rules(),
    *(rule for role in ROLE_FIELDS for rule in _override_rules(role)),
    *(_tensor_parallel_rule(role) for role in ROLE_FIELDS),
    *(rule for role in PRODUCER_ROLES for rule in _kv_transfer_range_rules(role)),
]


class InferenceDeploymentSpec(CrdModel):
    """A served model: prefill and decode pools (or one aggregated pool) behind a router."""

    model_config = {"json_schema_extra": validations(*SPEC_RULES)}

    model: ModelSpec = Field(description="The model served.")
    mode: Mode = Field(
        "disaggregated",
        description="disaggregated: prefill pods, decode pods and a router moving KV between them; "
        "aggregated: one pool doing both, behind the router. Immutable.",
    )
    engine: EngineSpec = Field(
        default_factory=EngineSpec,
        description="Engine settings of every engine pod; roles may override some.",
        json_schema_extra=object_default(EngineSpec),
    )
    prefill: RoleSpec | None = Field(None, description="Prefill pool (disaggregated mode).")
    decode: RoleSpec | None = Field(None, description="Decode pool (disaggregated mode).")
    pool: RoleSpec | None = Field(None, description="The single engine pool (aggregated mode).")
    router: RouterSpec = Field(
        default_factory=RouterSpec, description="The router.", json_schema_extra=object_default(RouterSpec)
    )
    kv_transfer: KVTransferSpec = Field(
        default_factory=KVTransferSpec,
        alias="kvTransfer",
        description="KV-cache transfer.",
        json_schema_extra=object_default(KVTransferSpec),
    )
    kv_events: KVEventsSpec = Field(
        default_factory=KVEventsSpec,
        alias="kvEvents",
        description="KV-cache events.",
        json_schema_extra=object_default(KVEventsSpec),
    )
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec,
        description="Replica ownership and the built-in autoscaler's policy.",
        json_schema_extra=object_default(AutoscalingSpec),
    )
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec,
        description="NetworkPolicies around the engine pods.",
        json_schema_extra=object_default(NetworkPolicySpec),
    )
    inference_pool: InferencePoolSettings = Field(
        default_factory=InferencePoolSettings,
        description="The Gateway API Inference Extension's InferencePool of the engine pods.",
        json_schema_extra=object_default(InferencePoolSettings),
    )

    @model_validator(mode="after")
    def _cross_field(self) -> InferenceDeploymentSpec:
        if self.mode == "aggregated":
            for role in ("prefill", "decode"):
                if getattr(self, role) is not None:
                    raise ValueError(
                        f"spec.{role} must be empty when spec.mode is aggregated (configure spec.pool)"
                    )
        elif self.pool is not None:
            raise ValueError(
                "spec.pool must be empty when spec.mode is disaggregated (configure spec.prefill and "
                "spec.decode)"
            )
        ports = {
            "engine.port": self.engine.port,
            "kvTransfer.port": self.kv_transfer.port,
            "kvEvents.port": self.kv_events.port,
            "kvEvents.replayPort": self.kv_events.replay_port,
        }
        for (a, pa), (b, pb) in combinations(ports.items(), 2):
            if pa == pb:
                raise ValueError(f"spec.{b} must differ from spec.{a} (one engine pod opens both)")
        bounds = self.autoscaling
        if self.mode == "disaggregated" and (bounds.prefill.min_replicas == 0) != (
            bounds.decode.min_replicas == 0
        ):
            raise ValueError(
                "spec.autoscaling.prefill.minReplicas and spec.autoscaling.decode.minReplicas must be 0 "
                "together (both pools scale to zero together) or both at least 1"
            )
        for role in ROLE_FIELDS:
            spec: RoleSpec | None = getattr(self, role)
            if spec is not None and spec.engine is not None:
                check_budget(self.engine.merged(spec.engine), f"spec.{role}.engine")
            if ROLE_MODES[role] == self.mode:
                role_spec = spec or RoleSpec()
                engine = self.engine.merged(role_spec.engine)
                check_tensor_parallel(engine, role_spec.resources.gpus, role)
                if role in PRODUCER_ROLES:
                    tp = tensor_parallel_size(engine, role_spec.resources.gpus)
                    others = {name: port for name, port in ports.items() if name != "kvTransfer.port"}
                    errors = kv_transfer_range_errors(self.kv_transfer.port, tp, others, role)
                    if errors:
                        raise ValueError("; ".join(errors))
        return self

    def roles(self) -> dict[str, RoleSpec]:
        """Engine pool name (contract role) -> its settings; absent roles get the defaults."""
        if self.mode == "aggregated":
            return {contract.ROLE_AGGREGATED: self.pool or RoleSpec()}
        return {
            contract.ROLE_PREFILL: self.prefill or RoleSpec(),
            contract.ROLE_DECODE: self.decode or RoleSpec(),
        }
