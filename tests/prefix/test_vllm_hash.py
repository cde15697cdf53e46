"""vLLM's block keys (sha256_cbor derived here by hand from the CBOR spec; sha256 over pickle)."""

from __future__ import annotations

import hashlib
import typing

import pytest

from baton_engine.config import EngineConfig
from baton_engine.contract import PREFIX_HASH_VLLM, PREFIX_HASH_VLLM_SHA256
from baton_engine.prefix.hashing import to_event_hash
from baton_engine.prefix.vllm_hash import VllmPrefixHasher, VllmSha256CborHasher


def test_seed_root_is_sha256_of_the_cbor_text_string() -> None:
    # CBOR text string of length 2 is 0x62 followed by the UTF-8 bytes.
    assert VllmSha256CborHasher("42").none_hash == hashlib.sha256(b"\x62" + b"42").digest()


def test_block_key_is_sha256_of_cbor_array_parent_tokens_none() -> None:
    hasher = VllmSha256CborHasher("42")
    root = hasher.none_hash
    # [bytes(32), [1, 24, 500], null]: array(3), bytes(32) header 0x58 0x20, array(3) with
    # 1 (0x01), 24 (0x18 0x18), 500 (0x19 0x01 0xf4), null (0xf6).
    cbor = b"\x83" + b"\x58\x20" + root + b"\x83\x01\x18\x18\x19\x01\xf4" + b"\xf6"
    first = hasher(None, (1, 24, 500))
    assert first == hashlib.sha256(cbor).digest()
    second_cbor = b"\x83\x58\x20" + first + b"\x83\x02\x03\x04\xf6"
    assert hasher(first, (2, 3, 4)) == hashlib.sha256(second_cbor).digest()


def test_event_form_is_the_low_64_bits() -> None:
    key = VllmSha256CborHasher("0")(None, (1, 2, 3, 4))
    assert to_event_hash(key) == int.from_bytes(key[-8:], "big")


def test_seed_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    assert VllmSha256CborHasher.from_environment().none_hash == VllmSha256CborHasher("1234").none_hash
    monkeypatch.setenv("PYTHONHASHSEED", "")
    assert VllmSha256CborHasher.from_environment().none_hash == hashlib.sha256(b"\x60").digest()


def test_unset_seed_is_vllms_fixed_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM 0.32: without PYTHONHASHSEED a cryptographic algorithm roots at H("vllm-none-hash"),
    # so independent processes (and Baton's router) agree without configuration.
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    a, b = VllmSha256CborHasher.from_environment(), VllmSha256CborHasher.from_environment()
    assert a.seed == "vllm-none-hash"
    text = b"vllm-none-hash"
    assert a.none_hash == b.none_hash == hashlib.sha256(bytes([0x60 + len(text)]) + text).digest()


def test_an_explicit_seed_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    assert VllmSha256CborHasher("0").none_hash == hashlib.sha256(b"\x61" + b"0").digest()


def test_vllm_sha256_is_sha256_of_the_protocol_5_pickle() -> None:
    import pickle

    hasher = VllmPrefixHasher(PREFIX_HASH_VLLM_SHA256, "vllm-none-hash")
    assert hasher.none_hash == hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    first = hasher(None, (1, 2))
    assert first == hashlib.sha256(pickle.dumps((hasher.none_hash, (1, 2), None), protocol=5)).digest()
    with pytest.raises(ValueError, match="'md5' is not one of vllm-sha256, vllm-sha256-cbor"):
        VllmPrefixHasher("md5")


def test_int_parent_is_rejected() -> None:
    with pytest.raises(TypeError, match="parent hash must be the parent's 32-byte digest, got int"):
        VllmSha256CborHasher("0")(5, (1,))


def test_engine_config_names_these_hashers() -> None:
    options = typing.get_args(EngineConfig.model_fields["prefix_hash"].annotation)
    assert {PREFIX_HASH_VLLM, PREFIX_HASH_VLLM_SHA256} <= set(options)
