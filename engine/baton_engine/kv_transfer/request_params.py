"""The HTTP server's check of a request's ``kv_transfer_params`` (torch-free; runs before the
engine core sees the request, so that bad params are an HTTP 400 and no connection is made)."""

from __future__ import annotations

from typing import Any

from baton_engine.contract import KVTransferParamsError
from baton_engine.kv_transfer.params import load_key, verify_params

_PRODUCER_LEG_KEYS = {"do_remote_decode", "do_remote_prefill"}


def check_request_params(raw: Any, *, role: str, prompts: list[list[int]], n: int) -> dict[str, Any] | None:
    """What to forward to the core: ``{"do_remote_decode": True}`` for a producer leg, the
    verified params for a consumer leg, None without params. Raises KVTransferParamsError."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise KVTransferParamsError("kv_transfer_params: must be an object")
    if len(prompts) * n != 1:
        raise KVTransferParamsError("kv_transfer_params: needs exactly one prompt and n=1")
    if raw.get("do_remote_decode") is True and set(raw) <= _PRODUCER_LEG_KEYS:
        if role not in ("producer", "both"):
            raise KVTransferParamsError(
                f"kv_transfer_params: this engine's kv_role is {role!r}, not producer"
            )
        return {"do_remote_decode": True}
    if role not in ("consumer", "both"):
        raise KVTransferParamsError(f"kv_transfer_params: this engine's kv_role is {role!r}, not consumer")
    params = verify_params(raw, load_key())
    if params.num_tokens != len(prompts[0]):
        raise KVTransferParamsError(
            f"kv_transfer_params.num_tokens: {params.num_tokens} != this request's "
            f"{len(prompts[0])} prompt tokens"
        )
    return params.to_dict()
