"""Put an example's pods on particular nodes without editing the example.

Examples stay cluster-agnostic; a test or demo overlays the nodeSelector (and tolerations) of its
own nodes, e.g. the local control plane's process nodes, onto every pool and the router.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

POOLS = ("prefill", "decode", "pool", "router")


def with_placement(
    doc: Mapping[str, Any], node_selector: Mapping[str, str], tolerations: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """A copy of an InferenceDeployment whose pools (present for its mode) and router land on
    nodes matching `node_selector`."""
    out = copy.deepcopy(dict(doc))
    spec = out["spec"]
    wanted = ["pool"] if spec.get("mode") == "aggregated" else ["prefill", "decode"]
    for key in [*wanted, "router"]:
        section = spec.setdefault(key, {})
        section["nodeSelector"] = {**section.get("nodeSelector", {}), **node_selector}
        if tolerations:
            section["tolerations"] = [*section.get("tolerations", []), *map(dict, tolerations)]
    return out
