"""OpenAI-shaped error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
from typing import Any

INVALID_REQUEST = "invalid_request_error"
UPSTREAM = "upstream_error"
UNAVAILABLE = "service_unavailable"


def error_body(
    message: str, type_: str, *, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_bytes(
    message: str, type_: str, *, param: str | None = None, code: str | int | None = None
) -> bytes:
    return json.dumps(error_body(message, type_, param=param, code=code)).encode()


def sse_error_frame(message: str, type_: str = UPSTREAM) -> bytes:
    """What a client sees when an upstream stream breaks after the headers were already sent."""
    return b"data: " + error_bytes(message, type_) + b"\n\n"
