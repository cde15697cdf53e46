"""Signed `kv_transfer_params`: built by the producer, verified by the consumer before anything.

The key is shared by one deployment's engine pods (env `BATON_KV_TRANSFER_KEY`, which the
operator fills from a Secret). Without a key a producer cannot sign and a consumer refuses every
params object, so a misconfigured pod fails loudly instead of trusting unsigned input.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from baton_engine import contract
from baton_engine.contract import KVTransferParams, KVTransferParamsError
from baton_engine.kv_transfer.protocol import CacheSpec


def load_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment's signing key from the environment, or None if unset or empty."""
    value = (os.environ if environ is None else environ).get(contract.ENV_KV_TRANSFER_KEY, "")
    return value.encode() if value else None


def require_key(environ: Mapping[str, str] | None = None) -> bytes:
    key = load_key(environ)
    if key is None:
        raise ValueError(
            f"KV transfer needs a signing key: set {contract.ENV_KV_TRANSFER_KEY} "
            "(the same value on every engine pod of the deployment)"
        )
    return key


def verify_params(raw: Any, key: bytes | None) -> KVTransferParams:
    """Schema, then signature; raise KVTransferParamsError (an HTTP 400) naming the problem.

    Must run before any connection to the host the params name.
    """
    if key is None:
        raise KVTransferParamsError(
            f"kv_transfer_params: this engine has no signing key ({contract.ENV_KV_TRANSFER_KEY} unset); "
            "it accepts no transferred KV"
        )
    return contract.verify_dict(raw, key)


def sign_params(
    *,
    key: bytes,
    engine_id: str,
    host: str,
    port: int,
    transfer_id: str,
    block_ids: list[int],
    num_tokens: int,
    first_token: int,
    spec: CacheSpec,
    model: str,
    lease_expires_at: float,
    kv_key: str = "",
    tp_size: int = 1,
    rank_ports: list[int] | None = None,
    num_kv_heads: int = 0,
) -> dict[str, Any]:
    """The producer's answer for one prefilled request, signed."""
    params = KVTransferParams(
        engine_id=engine_id,
        host=host,
        port=port,
        transfer_id=transfer_id,
        block_ids=list(block_ids),
        num_tokens=num_tokens,
        first_token=first_token,
        block_size=spec.block_size,
        dtype=spec.dtype,
        layout=spec.layout,
        model=model,
        lease_expires_at=lease_expires_at,
        kv_key=kv_key,
        tp_size=tp_size,
        rank_ports=list(rank_ports or []) if tp_size > 1 else [],
        num_kv_heads=num_kv_heads,
    )
    return params.signed(key).to_dict()
