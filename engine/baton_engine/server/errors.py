"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def server_overloaded(retry_after: int) -> APIError:
    return APIError(
        429,
        "the engine's request queue is full; retry later",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after)},
    )


def draining() -> APIError:
    return APIError(
        503,
        "the server is shutting down and accepts no new requests",
        type="service_unavailable",
        code="draining",
    )


def deadline_exceeded(timeout: float) -> APIError:
    return APIError(
        408,
        f"the request did not finish within its deadline of {timeout:g} s and was aborted",
        type="timeout_error",
        param="timeout",
        code="deadline_exceeded",
    )
