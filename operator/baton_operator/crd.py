"""The InferenceDeployment CRD (apiextensions.k8s.io/v1), generated from the pydantic models.

Pydantic emits JSON Schema 2020-12; a CRD needs a *structural* OpenAPI v3.0 schema: every node
typed, no `$ref`, no `anyOf` with null, no `additionalProperties: false`, OpenAPI's boolean form of
`exclusiveMinimum`, int-or-string quantities marked as such. `structural()` does that translation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from baton_operator import models

JSON = dict[str, Any]

#: Keys of pydantic's output that have no place in a CRD schema.
_DROPPED = {"title", "$defs"}
#: Keys written first in every node, so that the YAML reads top-down.
_LEADING_KEYS = ("type", "description", "default")
#: Whatever the root-level rule allows keeps every child name (`<name>-kv-transfer`, pod names with
#: their hash suffixes, Service names) a valid DNS-1035 label of at most 63 characters.
MAX_NAME_LENGTH = 40
NAME_RULES: list[JSON] = [
    {
        "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
        "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters (child names add suffixes)",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        "message": "metadata.name must be a DNS-1035 label (lowercase letters, digits, '-'; starts with a "
        "letter): it names Services",
        "reason": "FieldValueInvalid",
    },
]


def structural(node: Any, defs: JSON) -> Any:
    """Translate one pydantic JSON-Schema node (recursively) into a structural CRD schema node."""
    if isinstance(node, list):
        return [structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "anyOf" in node:
        node = _collapse_any_of(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}  # the field's own description/default win over the class's
    if node.get("default", 0) is None:
        del node["default"]
    out: JSON = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "const":  # not a CRD schema keyword: the API server would drop it silently
            out["enum"] = [value]
        elif key == "exclusiveMinimum":
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum":
            out["maximum"] = value
            out["exclusiveMaximum"] = True
        elif key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key in ("items", "anyOf"):
            out[key] = structural(value, defs)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = structural(value, defs)
            # `false` is implied by `properties` (pruning); `true` becomes preserve-unknown-fields.
        else:
            out[key] = value
    if out.get("x-kubernetes-preserve-unknown-fields"):
        out["type"] = "object"
        out.pop("additionalProperties", None)
    first = [k for k in _LEADING_KEYS if k in out]
    return {**{k: out[k] for k in first}, **{k: v for k, v in out.items() if k not in first}}


def _collapse_any_of(node: JSON) -> JSON:
    """`X | None` becomes X (optional = absent); `int | str` becomes an int-or-string."""
    options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
    if node.get("x-kubernetes-int-or-string"):
        return {**node, "anyOf": [{"type": "integer"}, {"type": "string"}]}
    if len(options) != 1:
        raise ValueError(f"cannot express anyOf {options} in a structural schema")
    return {**options[0], **node}


def _schema_of(model: type[models.InferenceDeploymentSpec] | type[models.InferenceDeploymentStatus]) -> JSON:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    result: JSON = structural(raw, raw.get("$defs", {}))
    return result


def openapi_schema() -> JSON:
    """The version's `openAPIV3Schema`."""
    return {
        "type": "object",
        "description": "A served model: prefill and decode pools (or one aggregated pool) behind a router.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "API version: baton.dev/v1alpha1."},
            "kind": {"type": "string", "description": "InferenceDeployment."},
            "metadata": {"type": "object"},
            "spec": _schema_of(models.InferenceDeploymentSpec),
            "status": _schema_of(models.InferenceDeploymentStatus),
        },
        "x-kubernetes-validations": NAME_RULES,
    }


PRINTER_COLUMNS: list[JSON] = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "description": "Served model name."},
    {
        "name": "Mode",
        "type": "string",
        "jsonPath": ".spec.mode",
        "description": "disaggregated or aggregated.",
    },
    {
        "name": "Prefill",
        "type": "string",
        "jsonPath": ".status.prefill.ready",
        "description": "Ready/desired.",
    },
    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.ready", "description": "Ready/desired."},
    {
        "name": "Pool",
        "type": "string",
        "jsonPath": ".status.pool.ready",
        "description": "Ready/desired of the aggregated pool.",
        "priority": 1,
    },
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        "description": "The Ready condition.",
    },
    {
        "name": "Endpoint",
        "type": "string",
        "jsonPath": ".status.endpoint",
        "description": "The router's in-cluster URL.",
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> JSON:
    """The whole CustomResourceDefinition."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{models.PLURAL}.{models.GROUP}",
            "labels": {"app.kubernetes.io/name": "baton", "app.kubernetes.io/part-of": "baton"},
        },
        "spec": {
            "group": models.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": models.KIND,
                "listKind": f"{models.KIND}List",
                "plural": models.PLURAL,
                "singular": models.SINGULAR,
                "shortNames": list(models.SHORT_NAMES),
                "categories": ["baton"],
            },
            "versions": [
                {
                    "name": models.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


HEADER = "# Generated by `baton-operator crd` from baton_operator.models. Do not edit.\n"
CRD_FILE = f"{models.PLURAL}.{models.GROUP}.yaml"
#: Where the generated CRD is committed, relative to the repository root.
OUTPUT_PATHS = (Path("crds") / CRD_FILE, Path("charts/baton/crds") / CRD_FILE)


def render() -> str:
    """The CRD as the YAML text that is committed."""
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100, allow_unicode=True)


def write(root: Path) -> list[Path]:
    """Write every committed copy under `root`; return the paths written."""
    text = render()
    written = []
    for rel in OUTPUT_PATHS:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
