"""Children with special apply rules: the signing-key Secret (create-only) and the PodMonitor
(only where the Prometheus Operator's CRD exists)."""

from __future__ import annotations

import base64
import secrets

from baton_engine import contract
from baton_operator.builders.common import BuildContext, Manifest, metadata, secret_name

PODMONITOR_CRD = "podmonitors.monitoring.coreos.com"
KEY_COMPONENT = "kv-transfer"
MONITOR_COMPONENT = "monitoring"


def new_signing_key() -> str:
    """A fresh random KV-transfer key (256 bits, hex)."""
    return secrets.token_hex(32)


def signing_key_secret(ctx: BuildContext, key: str) -> Manifest:
    """Created once and never read back by the operator; the engine pods get it as env."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(ctx.owner, secret_name(ctx.owner), KEY_COMPONENT),
        "type": "Opaque",
        "immutable": True,
        "data": {contract.SECRET_KEY_FIELD: base64.b64encode(key.encode()).decode()},
    }


def pod_monitor(ctx: BuildContext) -> Manifest:
    """Scrape every pod of the deployment (engines and router) on its http port."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": metadata(ctx.owner, ctx.owner.name, MONITOR_COMPONENT),
        "spec": {
            "selector": {"matchLabels": {contract.LABEL_DEPLOYMENT: ctx.owner.name}},
            "podMetricsEndpoints": [{"port": contract.PORT_HTTP, "path": contract.PATH_METRICS}],
        },
    }
