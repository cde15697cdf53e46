"""`spec.inferencePool`: the Gateway API Inference Extension's InferencePool of the engine pods."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from baton_operator.models.base import CrdModel, object_default

#: The port GIE's endpoint picker (EPP) serves its Envoy ext-proc gRPC on, in its Helm chart.
DEFAULT_PICKER_PORT = 9002
PICKER_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class EndpointPickerSpec(CrdModel):
    """The endpoint picker (EPP) Service a Gateway asks which engine pod serves each request."""

    name: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        pattern=PICKER_NAME_PATTERN,
        description="Service name of the endpoint picker, in the resource's namespace; default: "
        "<metadata.name>-epp.",
    )
    port: int = Field(DEFAULT_PICKER_PORT, ge=1, le=65535, description="Service port of the endpoint picker.")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose",
        description="When the picker does not answer: FailClose drops the request, FailOpen lets the "
        "Gateway pick an engine pod itself.",
    )


class InferencePoolSettings(CrdModel):
    """An InferencePool (inference.networking.k8s.io/v1) of the engine pods for Gateways."""

    enabled: bool = Field(
        True,
        description="Create an InferencePool named like the resource, selecting every engine pod (not "
        "the router), wherever the InferencePool CRD is installed; false deletes it.",
    )
    endpoint_picker: EndpointPickerSpec = Field(
        default_factory=EndpointPickerSpec,
        description="The endpoint picker the pool refers to.",
        json_schema_extra=object_default(EndpointPickerSpec),
    )
