"""One engine pool (prefill, decode or the aggregated pool): its Deployment and headless Service."""

from __future__ import annotations

import math

from baton_engine import contract
from baton_operator.builders.common import (
    BuildContext,
    Manifest,
    child_name,
    container_security_context,
    http_probe,
    metadata,
    pod_identity_env,
    secret_name,
)
from baton_operator.builders.model_volume import model_mount
from baton_operator.builders.workload import container_resources, deployment, pod_spec
from baton_operator.models import EngineSpec
from baton_operator.models.engine import tensor_parallel_size
from baton_operator.models.pods import Resources
from baton_operator.rollout.kv_key import kv_compat_key

ENGINE_CONTAINER = "engine"
CACHE_MOUNT = "/var/cache/baton"
STARTUP_PERIOD_S = 10
#: Cache locations moved off the read-only root filesystem onto the `cache` emptyDir.
CACHE_ENV: tuple[tuple[str, str], ...] = (
    ("HOME", "/tmp"),
    ("XDG_CACHE_HOME", CACHE_MOUNT),
    ("HF_HOME", f"{CACHE_MOUNT}/hf"),
    ("TRITON_CACHE_DIR", f"{CACHE_MOUNT}/triton"),
    ("TORCHINDUCTOR_CACHE_DIR", f"{CACHE_MOUNT}/inductor"),
)


def _switch(flag: str, on: bool) -> str:
    return flag if on else contract.negated(flag)


def engine_args(ctx: BuildContext, role: str, engine: EngineSpec, model_ref: str) -> list[str]:
    """`baton-engine serve` flags of one role: every setting as a flag, nothing in files."""
    spec = ctx.spec
    args = [
        contract.FLAG_MODEL, model_ref,
        contract.FLAG_SERVED_MODEL_NAME, spec.model.name,
        # $(VAR) is expanded by the kubelet: each pod binds its own address.
        contract.FLAG_HOST, f"$({contract.ENV_POD_IP})",
        contract.FLAG_PORT, str(engine.port),
        contract.FLAG_DEVICE, engine.device,
        contract.FLAG_DTYPE, engine.dtype,
        contract.FLAG_BLOCK_SIZE, str(engine.block_size),
        contract.FLAG_MAX_NUM_SEQS, str(engine.max_num_seqs),
        contract.FLAG_MAX_NUM_BATCHED_TOKENS, str(engine.max_num_batched_tokens),
        contract.FLAG_MAX_MODEL_LEN, str(engine.max_model_len),
        contract.FLAG_GPU_MEMORY_UTILIZATION, str(engine.gpu_memory_utilization),
        _switch(contract.FLAG_PREFIX_CACHING, engine.prefix_caching),
        contract.FLAG_PREFIX_HASH, engine.prefix_hash,
        _switch(contract.FLAG_CHUNKED_PREFILL, engine.chunked_prefill),
        contract.FLAG_MAX_QUEUE, str(engine.max_queued_requests),
        contract.FLAG_KV_ROLE, contract.KV_ROLE_OF[role],
        contract.FLAG_KV_TRANSFER_PORT, str(spec.kv_transfer.port),
        contract.FLAG_KV_LEASE_SECONDS, str(spec.kv_transfer.lease_seconds),
        contract.FLAG_KV_ON_FAILURE, spec.kv_transfer.on_failure,
        _switch(contract.FLAG_KV_EVENTS, spec.kv_events.enabled),
        contract.FLAG_KV_COMPAT_KEY, kv_compat_key(spec.model, engine),
        contract.FLAG_TENSOR_PARALLEL_SIZE, str(role_tensor_parallel_size(ctx, role)),
    ]  # fmt: skip
    if engine.num_kv_blocks is not None:
        args += [contract.FLAG_NUM_KV_BLOCKS, str(engine.num_kv_blocks)]
    if engine.quantization is not None:
        args += [contract.FLAG_QUANTIZATION, engine.quantization]
    if engine.kv_cache_dtype != "auto":
        args += [contract.FLAG_KV_CACHE_DTYPE, engine.kv_cache_dtype]
    if engine.prefix_hash_seed is not None:
        args += [contract.FLAG_PREFIX_HASH_SEED, engine.prefix_hash_seed]
    if spec.kv_events.enabled:
        args += [
            contract.FLAG_KV_EVENTS_PORT, str(spec.kv_events.port),
            contract.FLAG_KV_EVENTS_REPLAY_PORT, str(spec.kv_events.replay_port),
            contract.FLAG_KV_EVENTS_BUFFER_STEPS, str(spec.kv_events.buffer_steps),
            contract.FLAG_KV_EVENTS_ENCODING, spec.kv_events.encoding,
        ]  # fmt: skip
    return args + list(engine.extra_args)


def engine_ports(ctx: BuildContext, role: str, engine: EngineSpec) -> list[tuple[str, int]]:
    """Named ports one pod of `role` listens on (decode pods serve no pulls; a producer's rank r
    serves its KV heads on the KV-transfer port + r, named ``kv-transfer-r``)."""
    ports = [(contract.PORT_HTTP, engine.port)]
    if contract.KV_ROLE_OF[role] in ("producer", "both"):
        base = ctx.spec.kv_transfer.port
        ports.append((contract.PORT_KV_TRANSFER, base))
        ranks = role_tensor_parallel_size(ctx, role)
        ports += [(f"{contract.PORT_KV_TRANSFER}-{rank}", base + rank) for rank in range(1, ranks)]
    if ctx.spec.kv_events.enabled:
        ports.append((contract.PORT_KV_EVENTS, ctx.spec.kv_events.port))
        ports.append((contract.PORT_KV_EVENTS_REPLAY, ctx.spec.kv_events.replay_port))
    return ports


SHM_GIB_PER_RANK = 1
"""Memory-backed /dev/shm per rank of a tensor-parallel pod: NCCL/RCCL keep their intra-node
buffers there, and a container's default 64 MiB is too small for them."""


def role_tensor_parallel_size(ctx: BuildContext, role: str) -> int:
    """The ranks (GPUs) of one pod of `role`."""
    return tensor_parallel_size(role_engine(ctx, role), ctx.spec.roles()[role].resources.gpus)


def _resources(res: Resources) -> Manifest:
    gpus = {res.gpu_resource: str(res.gpus)} if res.gpus > 0 else {}
    return container_resources(res.cpu, res.memory, gpus)


def _env(ctx: BuildContext, engine: EngineSpec) -> list[Manifest]:
    env = pod_identity_env()
    env.append(
        {
            "name": contract.ENV_KV_TRANSFER_KEY,
            "valueFrom": {"secretKeyRef": {"name": secret_name(ctx.owner), "key": contract.SECRET_KEY_FIELD}},
        }
    )
    env += [{"name": name, "value": value} for name, value in CACHE_ENV]
    env += [{"name": e.name, "value": e.value} for e in engine.env]
    return env


def role_engine(ctx: BuildContext, role: str) -> EngineSpec:
    """The effective engine settings of one role: `spec.engine` with the role's overrides."""
    return ctx.spec.engine.merged(ctx.spec.roles()[role].engine)


def role_kv_key(ctx: BuildContext, role: str) -> str:
    """The KV-compatibility key of one role's pods (label, flag, rollout generation)."""
    return kv_compat_key(ctx.spec.model, role_engine(ctx, role))


def engine_pod_metadata(ctx: BuildContext, role: str, engine: EngineSpec) -> tuple[Manifest, Manifest]:
    """Labels and annotations an engine pod carries beyond its Deployment's: the engine and
    llm-d role labels, its KV-compatibility key, and how it hashes prompt blocks (the router
    hashes each pod's prompts its way, which differs between generations of a block-size
    rollout)."""
    labels = {
        **contract.engine_pod_labels(ctx.owner.name, role),
        contract.LABEL_KV_COMPAT: kv_compat_key(ctx.spec.model, engine),
    }
    annotations = {
        contract.ANNOTATION_BLOCK_SIZE: str(engine.block_size),
        contract.ANNOTATION_PREFIX_HASH: engine.prefix_hash,
    }
    if engine.prefix_hash_seed is not None:
        annotations[contract.ANNOTATION_PREFIX_HASH_SEED] = engine.prefix_hash_seed
    return labels, annotations


def engine_deployment(ctx: BuildContext, role: str) -> Manifest:
    role_spec = ctx.spec.roles()[role]
    engine = role_engine(ctx, role)
    model = model_mount(ctx.spec.model, engine.image, engine.image_pull_policy)
    name = child_name(ctx.owner, role)
    startup_failures = math.ceil(role_spec.startup_timeout_seconds / STARTUP_PERIOD_S)
    container: Manifest = {
        "name": ENGINE_CONTAINER,
        "image": engine.image,
        "imagePullPolicy": engine.image_pull_policy,
        "command": ["baton-engine", "serve"],
        "args": engine_args(ctx, role, engine, model.reference),
        "ports": [
            {"name": port_name, "containerPort": port, "protocol": "TCP"}
            for port_name, port in engine_ports(ctx, role, engine)
        ],
        "env": _env(ctx, engine),
        "resources": _resources(role_spec.resources),
        "startupProbe": http_probe(contract.PATH_HEALTH, STARTUP_PERIOD_S, startup_failures),
        "readinessProbe": http_probe(contract.PATH_READY, 5, 3),
        "livenessProbe": http_probe(contract.PATH_HEALTH, 10, 6, timeout=5),
        "securityContext": container_security_context(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": CACHE_MOUNT},
            *model.mounts,
        ],
    }
    volumes: list[Manifest] = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    ranks = role_tensor_parallel_size(ctx, role)
    if ranks > 1:
        size = f"{SHM_GIB_PER_RANK * ranks}Gi"  # counts against the container's memory limit
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}})
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    pod = pod_spec(
        role_spec,
        container,
        volumes=[*volumes, *model.volumes],
        init_containers=model.init_containers,
        termination_grace_s=role_spec.termination_grace_period_seconds,
    )
    pod_labels, pod_annotations = engine_pod_metadata(ctx, role, engine)
    # With accelerators a rollout must not need a spare one; without, keep serving during it.
    if role_spec.resources.gpus > 0:
        rolling_update = {"maxSurge": 0, "maxUnavailable": 1}
    else:
        rolling_update = {"maxSurge": 1, "maxUnavailable": 0}
    override = ctx.pools.get(role)
    replicas = role_spec.replicas if ctx.replicas_owned else None
    if replicas is not None and override is not None and override.replicas is not None:
        replicas = override.replicas
    # Paused only while a KV-key rollout needs it: left out otherwise (the API's default).
    paused = {"paused": True} if override is not None and override.paused else {}
    return deployment(
        ctx,
        name,
        role,
        pod,
        rolling_update,
        replicas=replicas,
        pod_labels=pod_labels,
        pod_annotations=pod_annotations,
        progressDeadlineSeconds=role_spec.startup_timeout_seconds + 300,
        **paused,
    )


def engine_service(ctx: BuildContext, role: str) -> Manifest:
    """Headless: peers and the router address pods directly; the name gives DNS per pod."""
    role_spec = ctx.spec.roles()[role]
    engine = ctx.spec.engine.merged(role_spec.engine)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ctx.owner, child_name(ctx.owner, role), role),
        "spec": {
            "clusterIP": "None",
            "selector": contract.pod_selector(ctx.owner.name, role),
            "ports": [
                {"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}
                for port_name, port in engine_ports(ctx, role, engine)
            ],
        },
    }
