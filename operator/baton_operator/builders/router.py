"""The router: Deployment, Service, and the ServiceAccount/Role/RoleBinding it watches Pods with."""

from __future__ import annotations

from baton_engine import contract
from baton_operator.builders.common import (
    BuildContext,
    Manifest,
    child_name,
    container_security_context,
    http_probe,
    metadata,
    pod_identity_env,
)
from baton_operator.builders.model_volume import model_mount
from baton_operator.builders.workload import container_resources, deployment, pod_spec

ROUTER_CONTAINER = "router"


def router_name(ctx: BuildContext) -> str:
    return child_name(ctx.owner, contract.ROLE_ROUTER)


def router_args(ctx: BuildContext, tokenizer: str) -> list[str]:
    spec = ctx.spec
    name = ctx.owner.name
    args = [
        contract.FLAG_ROUTER_DISCOVERY, contract.DISCOVERY_KUBERNETES,
        contract.FLAG_ROUTER_NAMESPACE, ctx.owner.namespace,
        # The router refuses the other mode's selectors: it must be told which roles it routes to.
        contract.FLAG_ROUTER_MODE, spec.mode,
    ]  # fmt: skip
    if spec.mode == "aggregated":
        args += [
            contract.FLAG_ROUTER_ENGINE_SELECTOR,
            contract.selector_arg(contract.pod_selector(name, contract.ROLE_AGGREGATED)),
        ]
    else:
        args += [
            contract.FLAG_ROUTER_PREFILL_SELECTOR,
            contract.selector_arg(contract.pod_selector(name, contract.ROLE_PREFILL)),
            contract.FLAG_ROUTER_DECODE_SELECTOR,
            contract.selector_arg(contract.pod_selector(name, contract.ROLE_DECODE)),
        ]
    # No block size, prefix hash or hash seed: the router reads each pod's from its annotations,
    # so that rolling out a new one neither restarts the router nor mis-hashes either generation.
    args += [
        contract.FLAG_ROUTER_MODEL, spec.model.name,
        contract.FLAG_ROUTER_TOKENIZER, tokenizer,
        contract.FLAG_ROUTER_HOST, f"$({contract.ENV_POD_IP})",
        contract.FLAG_ROUTER_PORT, str(spec.router.port),
        contract.FLAG_ROUTER_HOLD_QUEUE, str(spec.router.hold_queue),
        contract.FLAG_ROUTER_HOLD_TIMEOUT, str(spec.router.hold_timeout_seconds),
    ]  # fmt: skip
    events = contract.FLAG_ROUTER_KV_EVENTS
    args.append(events if spec.kv_events.enabled else contract.negated(events))
    return args


def router_deployment(ctx: BuildContext) -> Manifest:
    router = ctx.spec.router
    model = model_mount(ctx.spec.model, router.image, router.image_pull_policy, tokenizer_only=True)
    container: Manifest = {
        "name": ROUTER_CONTAINER,
        "image": router.image,
        "imagePullPolicy": router.image_pull_policy,
        "command": ["baton-router"],
        "args": router_args(ctx, model.reference),
        "ports": [{"name": contract.PORT_HTTP, "containerPort": router.port, "protocol": "TCP"}],
        "env": [*pod_identity_env(), {"name": "HOME", "value": "/tmp"}],
        "resources": container_resources(router.resources.cpu, router.resources.memory),
        "readinessProbe": http_probe(contract.PATH_READY, 5, 3),
        "livenessProbe": http_probe(contract.PATH_HEALTH, 10, 6, timeout=5),
        "securityContext": container_security_context(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *model.mounts],
    }
    pod = pod_spec(
        router,
        container,
        volumes=[{"name": "tmp", "emptyDir": {}}, *model.volumes],
        init_containers=model.init_containers,
        termination_grace_s=30,
        service_account=router_name(ctx),  # it watches Pods
    )
    return deployment(
        ctx,
        router_name(ctx),
        contract.ROLE_ROUTER,
        pod,
        {"maxSurge": 1, "maxUnavailable": 0},
        replicas=router.replicas,
    )


def router_service(ctx: BuildContext) -> Manifest:
    service = ctx.spec.router.service
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ctx.owner, router_name(ctx), contract.ROLE_ROUTER),
        "spec": {
            "type": service.type,
            "selector": contract.pod_selector(ctx.owner.name, contract.ROLE_ROUTER),
            "ports": [
                {
                    "name": contract.PORT_HTTP,
                    "port": service.port,
                    "targetPort": contract.PORT_HTTP,
                    "protocol": "TCP",
                }
            ],
        },
    }


def router_endpoint(ctx: BuildContext) -> str:
    """The in-cluster URL clients use (the router's Service)."""
    host = f"{router_name(ctx)}.{ctx.owner.namespace}.svc"
    return f"http://{host}:{ctx.spec.router.service.port}"


def router_service_account(ctx: BuildContext) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(ctx.owner, router_name(ctx), contract.ROLE_ROUTER),
        "automountServiceAccountToken": True,
    }


def router_role(ctx: BuildContext) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(ctx.owner, router_name(ctx), contract.ROLE_ROUTER),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }


def router_role_binding(ctx: BuildContext) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(ctx.owner, router_name(ctx), contract.ROLE_ROUTER),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": router_name(ctx)},
        "subjects": [{"kind": "ServiceAccount", "name": router_name(ctx), "namespace": ctx.owner.namespace}],
    }
