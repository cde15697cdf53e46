"""The HTTP server's check of a request's ``kv_transfer_params`` (torch-free; runs before the
engine core sees the request, so that bad params are an HTTP 400 and no connection is made)."""

from __future__ import annotations

from typing import Any

from baton_engine.contract import KVTransferParamsError
from baton_engine.kv_transfer.params import load_key, verify_params

#: What a prefill leg's params may hold. vLLM's P/D proxies send the request-side keys of vLLM's
#: connectors with every remote_* key null (null means absent), and newer ones the list of
#: requests they aborted on this prefiller (Baton needs none: an unpulled lease expires).
_VLLM_REMOTE_KEYS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
_VLLM_ABORTED_KEY = "aborted_request"


def _producer_leg(raw: dict[str, Any]) -> bool:
    """Whether `raw` asks this engine to prefill for a remote decode; raises on a malformed ask."""
    if raw.get("do_remote_decode") is not True:
        return False
    for key, value in raw.items():
        if key == "do_remote_decode" or value is None:
            continue
        if key == "do_remote_prefill":
            if value is not False:
                raise KVTransferParamsError(
                    "kv_transfer_params.do_remote_prefill: must be false or null on a prefill leg "
                    "(do_remote_decode is true)"
                )
        elif key in _VLLM_REMOTE_KEYS:
            raise KVTransferParamsError(
                f"kv_transfer_params.{key}: must be null on a prefill leg (do_remote_decode is true)"
            )
        elif key == _VLLM_ABORTED_KEY:
            if not isinstance(value, list) or not all(isinstance(r, str) for r in value):
                raise KVTransferParamsError(f"kv_transfer_params.{key}: must be a list of request ids")
        else:
            raise KVTransferParamsError(f"kv_transfer_params.{key}: unknown field for a prefill leg")
    return True


def check_request_params(raw: Any, *, role: str, prompts: list[list[int]], n: int) -> dict[str, Any] | None:
    """What to forward to the core: ``{"do_remote_decode": True}`` for a producer leg (Baton's
    own ask, or a vLLM proxy's with its null remote_* keys), the verified params for a consumer
    leg (a proxy forwards them as the producer returned them), None without params. Raises
    KVTransferParamsError naming the offending field."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise KVTransferParamsError("kv_transfer_params: must be an object")
    if len(prompts) * n != 1:
        raise KVTransferParamsError("kv_transfer_params: needs exactly one prompt and n=1")
    if _producer_leg(raw):
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
