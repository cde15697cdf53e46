"""Where pods may run: node selectors, tolerations, affinity and priority class (the core/v1
shapes), validated as the API server validates them in a pod, so that a spec the CRD accepts
never yields a Deployment the API server refuses.

Field names and rules are Kubernetes' (label syntax, toleration and selector operators). The
lists are bounded, which Kubernetes does not do, to keep the CEL rules within the API server's
cost budget; the bounds are far above what a scheduling constraint needs.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StringConstraints, ValidationInfo, field_validator

from baton_operator.models.base import CrdModel, cel, validations

#: A DNS-1123 subdomain: dot-separated lowercase labels (names of Secrets, claims, classes).
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
DNS_SUBDOMAIN_PATTERN = rf"^{DNS_SUBDOMAIN}$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: A label key: an optional DNS-subdomain prefix of at most 253 characters and '/', then a name
#: of at most 63 alphanumerics, '-', '_' or '.', alphanumeric at both ends.
QUALIFIED_NAME = rf"({DNS_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?"
QUALIFIED_NAME_PATTERN = rf"^{QUALIFIED_NAME}$"
MAX_PREFIX = 253
MAX_QUALIFIED_NAME = MAX_PREFIX + 1 + 63
#: A label value: empty, or at most 63 alphanumerics, '-', '_' or '.', alphanumeric at both ends.
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
MAX_LABEL_VALUE = 63
MAX_LABELS = 64
MAX_TERMS = 8
MAX_EXPRESSIONS = 16
MAX_VALUES = 64
MAX_NAMESPACES = 64
QUALIFIED_NAME_RULE = (
    "an optional DNS-subdomain prefix and '/', then at most 63 alphanumerics, '-', '_' or '.'"
)


def qualified_name_problem(key: str) -> str | None:
    """Why `key` is not a valid label key; None when it is."""
    if len(key.rpartition("/")[0]) > MAX_PREFIX:
        return f"the prefix of {key!r} is longer than {MAX_PREFIX} characters"
    if not re.fullmatch(QUALIFIED_NAME, key):
        return f"{key!r} is not a qualified name ({QUALIFIED_NAME_RULE})"
    return None


def _qualified(key: str) -> str:
    problem = qualified_name_problem(key)
    if problem is not None:
        raise ValueError(problem)
    return key


QualifiedName = Annotated[str, AfterValidator(_qualified), StringConstraints(max_length=MAX_QUALIFIED_NAME)]
LabelValue = Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE, pattern=LABEL_VALUE_PATTERN)]
#: Map keys have no schema of their own in a CRD: CEL checks them.
LabelKey = Annotated[str, AfterValidator(_qualified)]


def _qualified_field(description: str) -> Any:
    return Field(
        max_length=MAX_QUALIFIED_NAME,
        pattern=QUALIFIED_NAME_PATTERN,
        description=description,
        json_schema_extra=validations(
            cel(
                f"self.indexOf('/') <= {MAX_PREFIX}",
                f"the prefix (before '/') must be at most {MAX_PREFIX} characters",
            )
        ),
    )


def label_map(description: str) -> Any:
    """A map of label keys to label values (a nodeSelector, matchLabels)."""
    return Field(
        default_factory=dict,
        description=description,
        json_schema_extra={
            "maxProperties": MAX_LABELS,
            **validations(
                cel(
                    f"self.all(k, k.matches('{QUALIFIED_NAME_PATTERN}') && k.indexOf('/') <= {MAX_PREFIX})",
                    f"keys must be label keys: {QUALIFIED_NAME_RULE}",
                )
            ),
        },
    )


class Toleration(CrdModel):
    """A pod toleration (the core/v1 Toleration fields)."""

    model_config = {
        "json_schema_extra": validations(
            cel(
                "self.operator != 'Exists' || !has(self.value)",
                "tolerations[].value must be empty when operator is Exists",
                ".value",
            ),
            cel(
                "(has(self.key) && self.key != '') || self.operator == 'Exists'",
                "tolerations[].operator must be Exists when key is empty (it tolerates every taint)",
                ".operator",
            ),
            cel(
                "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
                "tolerations[].tolerationSeconds is only allowed with effect NoExecute",
                ".tolerationSeconds",
            ),
        )
    }

    key: str | None = Field(
        None,
        max_length=MAX_QUALIFIED_NAME,
        pattern=rf"^({QUALIFIED_NAME})?$",
        description="Taint key; empty with Exists tolerates all.",
        json_schema_extra=validations(
            cel(
                f"self.indexOf('/') <= {MAX_PREFIX}",
                f"tolerations[].key: the prefix (before '/') must be at most {MAX_PREFIX} characters",
            )
        ),
    )
    operator: Literal["Exists", "Equal"] = Field(
        "Equal", validate_default=True, description="Exists or Equal."
    )
    value: str | None = Field(
        None, max_length=MAX_LABEL_VALUE, pattern=LABEL_VALUE_PATTERN, description="Taint value (Equal only)."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty tolerates all effects."
    )
    toleration_seconds: int | None = Field(None, description="How long a NoExecute taint is tolerated.")

    @field_validator("key")
    @classmethod
    def _key(cls, key: str | None) -> str | None:
        if key:
            _qualified(key)
        return key

    @field_validator("operator")
    @classmethod
    def _operator(cls, operator: str, info: ValidationInfo) -> str:
        if not info.data.get("key") and operator != "Exists":
            raise ValueError(
                "tolerations[].operator must be Exists when key is empty (it tolerates every taint)"
            )
        return operator

    @field_validator("value")
    @classmethod
    def _value(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("operator") == "Exists" and value is not None:
            raise ValueError("tolerations[].value must be empty when operator is Exists")
        return value

    @field_validator("toleration_seconds")
    @classmethod
    def _seconds(cls, seconds: int | None, info: ValidationInfo) -> int | None:
        if seconds is not None and info.data.get("effect") != "NoExecute":
            raise ValueError("tolerations[].tolerationSeconds is only allowed with effect NoExecute")
        return seconds


def _values_rules(operators: str) -> list[dict[str, str]]:
    rules = [
        cel(
            "!(self.operator in ['In', 'NotIn']) || (has(self.values) && size(self.values) > 0)",
            "values must not be empty when operator is In or NotIn",
            ".values",
        ),
        cel(
            "!(self.operator in ['Exists', 'DoesNotExist']) || !has(self.values) || size(self.values) == 0",
            "values must be empty when operator is Exists or DoesNotExist",
            ".values",
        ),
    ]
    if "Gt" in operators:
        rules.append(
            cel(
                "!(self.operator in ['Gt', 'Lt']) || (has(self.values) && size(self.values) == 1 && "
                "self.values[0].matches('^[0-9]+$'))",
                "values must be one integer when operator is Gt or Lt",
                ".values",
            )
        )
    return rules


def _check_values(operator: str, values: list[str]) -> None:
    if operator in ("In", "NotIn") and not values:
        raise ValueError("values must not be empty when operator is In or NotIn")
    if operator in ("Exists", "DoesNotExist") and values:
        raise ValueError("values must be empty when operator is Exists or DoesNotExist")
    if operator in ("Gt", "Lt") and not (len(values) == 1 and re.fullmatch(r"[0-9]+", values[0])):
        raise ValueError("values must be one integer when operator is Gt or Lt")


class _Requirement(CrdModel):
    """The checks of a label requirement (a subclass declares key, operator and values, in that
    order: values are checked against the operator)."""

    @field_validator("key", check_fields=False)
    @classmethod
    def _key(cls, key: str) -> str:
        return _qualified(key)

    @field_validator("values", check_fields=False)
    @classmethod
    def _values(cls, values: list[str], info: ValidationInfo) -> list[str]:
        _check_values(str(info.data.get("operator")), values)
        return values


class NodeSelectorRequirement(_Requirement):
    """A node label the node must (not) have, or a value range it must be in."""

    model_config = {"json_schema_extra": validations(*_values_rules("In NotIn Exists DoesNotExist Gt Lt"))}

    key: str = _qualified_field("Node label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(
        description="How the label's value is compared with values."
    )
    values: list[LabelValue] = Field(
        default_factory=list,
        max_length=MAX_VALUES,
        validate_default=True,
        description="Label values the operator compares with (Gt, Lt: one non-negative integer).",
    )


class NodeFieldRequirement(CrdModel):
    """A node field the node must (not) have: only the node's name."""

    key: Literal["metadata.name"] = Field(description="The node field: metadata.name.")
    operator: Literal["In", "NotIn"] = Field(description="In or NotIn.")
    values: list[Annotated[str, StringConstraints(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]] = Field(
        min_length=1, max_length=1, description="The node name."
    )


class NodeSelectorTerm(CrdModel):
    """Requirements a node must meet together."""

    match_expressions: list[NodeSelectorRequirement] = Field(
        default_factory=list, max_length=MAX_EXPRESSIONS, description="Requirements on node labels."
    )
    match_fields: list[NodeFieldRequirement] = Field(
        default_factory=list, max_length=MAX_EXPRESSIONS, description="Requirements on node fields."
    )


class NodeSelector(CrdModel):
    """Node selector terms, any one of which a node must meet."""

    node_selector_terms: list[NodeSelectorTerm] = Field(
        min_length=1, max_length=MAX_TERMS, description="At least one term."
    )


class PreferredSchedulingTerm(CrdModel):
    """A node preference and its weight."""

    weight: int = Field(ge=1, le=100, description="Weight in the scheduler's scoring, 1 to 100.")
    preference: NodeSelectorTerm = Field(description="The nodes preferred.")


class NodeAffinity(CrdModel):
    """Which nodes the pods must or should run on."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        None, description="Nodes the pods must run on."
    )
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=MAX_TERMS, description="Nodes the pods should run on."
    )


class LabelSelectorRequirement(_Requirement):
    """A label a pod must (not) have."""

    model_config = {"json_schema_extra": validations(*_values_rules("In NotIn Exists DoesNotExist"))}

    key: str = _qualified_field("Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How the label's value is compared with values."
    )
    values: list[LabelValue] = Field(
        default_factory=list,
        max_length=MAX_VALUES,
        validate_default=True,
        description="Label values the operator compares with.",
    )


class LabelSelector(CrdModel):
    """Pods (or namespaces) by their labels."""

    match_labels: dict[LabelKey, LabelValue] = label_map("Labels, each of which must match.")
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=MAX_EXPRESSIONS, description="Requirements, each of which must hold."
    )


class PodAffinityTerm(CrdModel):
    """Pods near which (or away from which) the pods are placed, by topology domain."""

    model_config = {
        "json_schema_extra": validations(
            cel(
                "has(self.labelSelector) || ("
                "(!has(self.matchLabelKeys) || size(self.matchLabelKeys) == 0) && "
                "(!has(self.mismatchLabelKeys) || size(self.mismatchLabelKeys) == 0))",
                "matchLabelKeys and mismatchLabelKeys need a labelSelector",
                ".labelSelector",
            )
        )
    }

    label_selector: LabelSelector | None = Field(None, description="The pods.")
    namespace_selector: LabelSelector | None = Field(None, description="Namespaces the pods are in.")
    namespaces: list[Annotated[str, StringConstraints(max_length=63, pattern=DNS_LABEL_PATTERN)]] = Field(
        default_factory=list, max_length=MAX_NAMESPACES, description="Namespaces the pods are in."
    )
    topology_key: str = _qualified_field("Node label whose value is the topology domain, e.g. a zone.")
    match_label_keys: list[QualifiedName] = Field(
        default_factory=list,
        max_length=MAX_EXPRESSIONS,
        description="Label keys whose values must equal the pod's.",
    )
    mismatch_label_keys: list[QualifiedName] = Field(
        default_factory=list,
        max_length=MAX_EXPRESSIONS,
        description="Label keys whose values must differ from the pod's.",
    )

    @field_validator("topology_key")
    @classmethod
    def _topology_key(cls, key: str) -> str:
        return _qualified(key)

    @field_validator("mismatch_label_keys")
    @classmethod
    def _label_keys(cls, keys: list[str], info: ValidationInfo) -> list[str]:
        if (keys or info.data.get("match_label_keys")) and info.data.get("label_selector") is None:
            raise ValueError("matchLabelKeys and mismatchLabelKeys need a labelSelector")
        return keys


class WeightedPodAffinityTerm(CrdModel):
    """A pod (anti-)affinity preference and its weight."""

    weight: int = Field(ge=1, le=100, description="Weight in the scheduler's scoring, 1 to 100.")
    pod_affinity_term: PodAffinityTerm = Field(description="The term.")


class PodAffinity(CrdModel):
    """Pods the pods must or should be placed near (or, as anti-affinity, away from)."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, max_length=MAX_TERMS, description="Terms that must hold."
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, max_length=MAX_TERMS, description="Terms that should hold."
    )


class Affinity(CrdModel):
    """Node affinity, pod affinity and pod anti-affinity (core/v1 Affinity)."""

    node_affinity: NodeAffinity | None = Field(None, description="Nodes the pods run on.")
    pod_affinity: PodAffinity | None = Field(None, description="Pods the pods run near.")
    pod_anti_affinity: PodAffinity | None = Field(None, description="Pods the pods run away from.")


class Placement(CrdModel):
    """Scheduling constraints shared by engine roles and the router."""

    node_selector: dict[LabelKey, LabelValue] = label_map("Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="Pod tolerations.")
    affinity: Affinity | None = Field(
        None,
        description="Node affinity, pod affinity and pod anti-affinity (core/v1 Affinity), validated as "
        "the API server validates them in a pod.",
    )
    priority_class_name: str | None = Field(
        None,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="PriorityClass of the pods (a DNS subdomain).",
    )
