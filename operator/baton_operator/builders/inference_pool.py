"""The InferencePool of the Gateway API Inference Extension (GIE): the engine pods as one pool a
Gateway routes to through an endpoint picker (llm-d's scheduler, GIE's EPP). Applied only where
its CRD is installed."""

from __future__ import annotations

from baton_engine import contract
from baton_operator.builders.common import BuildContext, Manifest, metadata

INFERENCE_POOL_CRD = "inferencepools.inference.networking.k8s.io"
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
INFERENCE_POOL_KIND = "InferencePool"
POOL_COMPONENT = "inference-pool"


def picker_name(ctx: BuildContext) -> str:
    return ctx.spec.inference_pool.endpoint_picker.name or f"{ctx.owner.name}-epp"


def inference_pool(ctx: BuildContext) -> Manifest:
    """Every engine pod of the deployment (prefill and decode, or the aggregated pool; never the
    router) on its HTTP port. The picker tells roles apart by their `llm-d.ai/role` label."""
    picker = ctx.spec.inference_pool.endpoint_picker
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": INFERENCE_POOL_KIND,
        "metadata": metadata(ctx.owner, ctx.owner.name, POOL_COMPONENT),
        "spec": {
            "selector": {"matchLabels": contract.engine_pods_selector(ctx.owner.name)},
            "targetPorts": [{"number": ctx.spec.engine.port}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker_name(ctx),
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }
