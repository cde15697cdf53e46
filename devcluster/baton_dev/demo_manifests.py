"""What the demo installs, placed on the local control plane's process nodes.

The example and the chart stay cluster-agnostic: the demo adds a nodeSelector for its own nodes
(the chart's `nodeSelector` value; `spec.<pool>.nodeSelector` of the InferenceDeployment), the
way a user would add one for GPU nodes of a real cluster.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from baton_dev import spec as names

PROCESS_NODES: dict[str, str] = {names.NODE_TYPE_LABEL: "process"}


def with_node_selector(doc: Mapping[str, Any], node_selector: Mapping[str, str]) -> dict[str, Any]:
    """A copy of an InferenceDeployment whose pools (those of its mode) and router select
    `node_selector` (merged over any selector they already have)."""
    out = copy.deepcopy(dict(doc))
    spec = out.get("spec")
    if not isinstance(spec, dict):
        raise ValueError("InferenceDeployment without a spec")
    pools = ["pool"] if spec.get("mode") == "aggregated" else ["prefill", "decode"]
    for key in [*pools, "router"]:
        section = spec.setdefault(key, {})
        section["nodeSelector"] = {**section.get("nodeSelector", {}), **node_selector}
    return out


def chart_values(node_selector: Mapping[str, str]) -> dict[str, Any]:
    """Helm values for the operator on a one-machine cluster: one replica on the given nodes."""
    return {"replicaCount": 1, "nodeSelector": dict(node_selector)}
