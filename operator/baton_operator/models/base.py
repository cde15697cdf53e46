"""The base of every CRD model: camelCase field names in YAML, snake_case in Python."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class CrdModel(BaseModel):
    """Fields are written in camelCase in the resource; unknown fields are refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=False,
    )


def cel(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry; the message always names the field it is about.

    No backslashes: a regex inside a CEL string literal would need them doubled; write `[.]`."""
    if "\\" in rule:
        raise ValueError(f"CEL rule with a backslash (use character classes such as [.]): {rule}")
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    if reason:
        entry["reason"] = reason
    return entry


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    """`json_schema_extra` carrying CEL rules into the generated CRD schema."""
    return {"x-kubernetes-validations": list(rules)}


def object_default(model: type[CrdModel]) -> dict[str, Any]:
    """`json_schema_extra` giving an object field the full default object.

    A bare `default: {}` is not enough: the API server checks a default against the CEL rules of its
    object *before* filling in the nested defaults, so the rules would see missing keys.
    """
    return {"default": model().model_dump(by_alias=True, exclude_none=True, mode="json")}
