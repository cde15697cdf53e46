from __future__ import annotations

import pytest

from baton_engine.kv_transfer import protocol
from baton_engine.kv_transfer.protocol import CacheSpec, Kind


def test_encode_decode_round_trip() -> None:
    frames = protocol.encode(Kind.PULL, {"pull_id": "p", "block_ids": [3, 4]})
    assert frames[0] == b"BKV1"
    assert frames[1] == b"PULL"
    assert protocol.decode(frames) == (Kind.PULL, {"pull_id": "p", "block_ids": [3, 4]})


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"BKV1", b"PULL"], "expected at least 3 frames, got 2"),
        ([b"XXXX", b"PULL", b"\x80"], "bad magic b'XXXX'"),
        ([b"BKV1", b"NOPE", b"\x80"], "unknown message kind b'NOPE'"),
        ([b"BKV1", b"PULL", b"\x93\x01\x02\x03"], "header: must be a map"),
        ([b"BKV1", b"PULL", b"\xc1"], "undecodable header"),
    ],
)
def test_decode_names_the_problem(frames: list[bytes], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        protocol.decode(frames)


def test_block_runs() -> None:
    assert protocol.block_runs([]) == []
    assert protocol.block_runs([5]) == [(0, 5, 1)]
    assert protocol.block_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]


def test_spec_sizes_and_mismatch() -> None:
    smollm2 = CacheSpec(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")
    assert smollm2.row_bytes == 16 * 3 * 64 * 4
    assert smollm2.block_bytes == 30 * 2 * 16 * 3 * 64 * 4
    other = CacheSpec(num_layers=30, block_size=32, num_kv_heads=3, head_dim=64, dtype="bfloat16")
    assert smollm2.mismatch(smollm2) is None
    assert smollm2.mismatch(other) == "block_size 16 != 32, dtype 'float32' != 'bfloat16'"


def test_spec_from_dict_rejects_bad_fields() -> None:
    good = CacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16").to_dict()
    assert CacheSpec.from_dict(good).dtype == "float16"
    with pytest.raises(ValueError, match="spec.head_dim: missing or not int"):
        CacheSpec.from_dict({**good, "head_dim": "8"})
    with pytest.raises(ValueError, match="spec.dtype: unsupported 'int4'"):
        CacheSpec.from_dict({**good, "dtype": "int4"})
