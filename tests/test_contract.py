"""The contract between the planes: kv_transfer_params signing and validation, topics, selectors,
ports. (That neither plane imports the other's heavy dependencies is import-linter's job:
pyproject's ``[tool.importlinter]``, run by ``make test``.)"""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from baton_engine import contract
from baton_engine.contract import KVTransferParams, KVTransferParamsError, verify_dict

KEY = b"k" * 32


def _params(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "engine_id": "e1",
        "host": "127.0.0.5",
        "port": 5600,
        "transfer_id": "t-1",
        "block_ids": [3, 4, 9],
        "num_tokens": 40,
        "first_token": 17,
        "block_size": 16,
        "dtype": "float32",
    }
    base.update(over)
    return base


def test_sign_and_verify_roundtrip() -> None:
    signed = KVTransferParams.from_dict(_params()).signed(KEY).to_dict()
    assert len(signed["signature"]) == 64
    parsed = verify_dict(json.loads(json.dumps(signed)), KEY)
    assert parsed.block_ids == [3, 4, 9]
    assert parsed.first_token == 17


def test_kv_key_is_signed_and_an_empty_one_keeps_the_old_signature() -> None:
    """kv_key is covered by the signature; params without one sign exactly as before the field
    existed (a pod of an older version verifies them)."""
    keyed = KVTransferParams.from_dict(_params(kv_key="3f9a")).signed(KEY).to_dict()
    assert verify_dict(keyed, KEY).kv_key == "3f9a"
    with pytest.raises(KVTransferParamsError, match="signature: does not match"):
        verify_dict({**keyed, "kv_key": "other"}, KEY)
    plain = KVTransferParams.from_dict(_params()).signed(KEY)
    assert b"kv_key" not in plain.payload()
    old_style = hmac.new(KEY, json.dumps(_params() | {"layout": contract.KV_LAYOUT, "model": "",
        "lease_expires_at": 0.0, "version": 1}, sort_keys=True, separators=(",", ":")).encode(),
        hashlib.sha256).hexdigest()  # fmt: skip
    assert plain.signature == old_style
    with pytest.raises(KVTransferParamsError, match=r"kv_transfer_params\.kv_key: wrong type int"):
        KVTransferParams.from_dict(_params(kv_key=3))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("signature"), "kv_transfer_params.signature: missing"),
        (lambda d: d.update(signature="00" * 32), "kv_transfer_params.signature: does not match"),
        (lambda d: d.update(block_ids=[3, 4, 10]), "kv_transfer_params.signature: does not match"),
        (lambda d: d.update(port="5600"), "kv_transfer_params.port: wrong type str"),
        (lambda d: d.update(block_ids=[3, -1, 9]), "kv_transfer_params.block_ids: must be non-negative"),
        (lambda d: d.pop("host"), "kv_transfer_params.host: required"),
        (lambda d: d.update(extra=1), "kv_transfer_params.extra: unknown field"),
        (lambda d: d.update(num_tokens=49), "kv_transfer_params.num_tokens: inconsistent"),
        (lambda d: d.update(first_token=True), "kv_transfer_params.first_token: wrong type bool"),
    ],
)
def test_bad_params_name_the_field(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    signed = KVTransferParams.from_dict(_params()).signed(KEY).to_dict()
    mutate(signed)
    with pytest.raises(KVTransferParamsError, match=message.replace(".", r"\.")):
        verify_dict(signed, KEY)


def test_wrong_key_is_refused() -> None:
    signed = KVTransferParams.from_dict(_params()).signed(KEY).to_dict()
    with pytest.raises(KVTransferParamsError, match="does not match"):
        verify_dict(signed, b"other-key")


def test_topic_and_selector() -> None:
    assert contract.kv_events_topic("127.0.0.9:5557", "smollm2") == "kv@127.0.0.9:5557@smollm2"
    assert contract.pod_selector("demo", "prefill") == {
        "baton.dev/deployment": "demo",
        "baton.dev/role": "prefill",
    }
    assert all(len(p) <= 15 for p in contract.DEFAULT_PORTS)
