"""vLLM v0.22.0 wire format (the array encoding): exact bytes, an independent decoder, and bad input."""

from __future__ import annotations

import pytest

from baton_engine.prefix.hashing import to_event_hash
from baton_engine.prefix.wire import (
    ENCODING_ARRAY,
    REPLAY_END_SEQ,
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    WireFormatError,
    decode_batch,
    decode_sequence,
    encode_batch,
    encode_sequence,
    frames,
)
from tests.prefix.records import AllBlocksCleared, BlocksRemoved, BlocksStored
from tests.prefix.reference_decoder import Float, Int, decode_event_batch, read_msgpack

U64 = 2**64 - 1
HASHES = (U64, 0, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63, 12345678901234567)
TOKENS = (0, 1, 127, 128, 255, 256, 65535, 65536, 151643, 2**31 - 1, *range(10, 22))

# msgspec 0.23.0 encoding vLLM v0.22.0's own structs (EventBatch / BlockStored / BlockRemoved /
# AllBlocksCleared, array_like + tag + omit_defaults) for the same four events, ts=1764470000.123456,
# data_parallel_rank=0, medium "GPU", group_idx 0, extra_keys one None per block.
MSGSPEC_GOLDEN = bytes.fromhex(
    "93cb41da4aeb3c07e6b4949cab426c6f636b53746f7265649bcfffffffffffffffff007fcc80ccffcd0100cdffffce"
    "00010000cf0000000100000000cf8000000000000000cf002bdc545d6b4b87c0dc001600017fcc80ccffcd0100cdff"
    "ffce00010000ce0002505bce7fffffff0a0b0c0d0e0f10111213141502c0a3475055c09bc0c0c0c0c0c0c0c0c0c0c0"
    "00c0c09cab426c6f636b53746f7265649105cfffffffffffffffff92010202c0a3475055c091c000c0c094ac426c6f"
    "636b52656d6f7665649201cfffffffffffffffffa34750550091b0416c6c426c6f636b73436c656172656400"
)

GOLDEN_RECORDS = [
    BlocksStored(HASHES, None, TOKENS, 2),
    BlocksStored((5,), U64, (1, 2), 2),
    BlocksRemoved((1, U64)),
    AllBlocksCleared(),
]


def test_batch_bytes_equal_vllm_msgspec_encoding() -> None:
    assert (
        encode_batch(GOLDEN_RECORDS, ts=1764470000.123456, data_parallel_rank=0, encoding=ENCODING_ARRAY)
        == MSGSPEC_GOLDEN
    )


def test_independent_decoder_reads_every_field_in_vllm_order() -> None:
    payload = encode_batch(
        GOLDEN_RECORDS, ts=1764470000.123456, data_parallel_rank=0, encoding=ENCODING_ARRAY
    )
    batch = decode_event_batch(payload)
    assert batch["ts"] == 1764470000.123456
    assert batch["data_parallel_rank"] == 0
    assert batch["events"] == [
        {
            "type": "BlockStored",
            "block_hashes": list(HASHES),
            "parent_block_hash": None,
            "token_ids": list(TOKENS),
            "block_size": 2,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None] * len(HASHES),
            "group_idx": 0,
            "kv_cache_spec_kind": None,
            "kv_cache_spec_sliding_window": None,
        },
        {
            "type": "BlockStored",
            "block_hashes": [5],
            "parent_block_hash": U64,
            "token_ids": [1, 2],
            "block_size": 2,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None],
            "group_idx": 0,
            "kv_cache_spec_kind": None,
            "kv_cache_spec_sliding_window": None,
        },
        {"type": "BlockRemoved", "block_hashes": [1, U64], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]


def test_ints_use_minimal_msgpack_widths_and_ts_is_float64() -> None:
    top = read_msgpack(
        encode_batch(
            [BlocksStored(HASHES, None, TOKENS, 2)], ts=1.0, data_parallel_rank=None, encoding=ENCODING_ARRAY
        )
    )
    assert top[0] == Float(1.0, "float64")
    assert top[2] is None  # a None rank is written, not omitted (array-like structs keep every field)
    hashes = top[1][0][1]
    assert [h.fmt for h in hashes] == [
        "uint64",
        "fixint",
        "fixint",
        "uint8",
        "uint8",
        "uint16",
        "uint16",
        "uint32",
        "uint64",
        "uint64",
        "uint64",
    ]
    assert hashes[0] == Int(U64, "uint64")


def test_digest_hashes_become_their_last_eight_bytes() -> None:
    digest = bytes(range(32))
    assert to_event_hash(digest) == int.from_bytes(bytes(range(24, 32)), "big")
    payload = encode_batch([BlocksStored((digest,), digest, (7, 8), 2)], ts=0.0, encoding=ENCODING_ARRAY)
    event = decode_event_batch(payload)["events"][0]
    assert event["block_hashes"] == [0x18191A1B1C1D1E1F]
    assert event["parent_block_hash"] == 0x18191A1B1C1D1E1F


def test_product_decoder_roundtrip() -> None:
    payload = encode_batch(GOLDEN_RECORDS, ts=3.5, data_parallel_rank=2, encoding=ENCODING_ARRAY)
    assert decode_batch(payload) == WireBatch(
        ts=3.5,
        events=(
            WireBlockStored(HASHES, None, TOKENS, 2, "GPU"),
            WireBlockStored((5,), U64, (1, 2), 2, "GPU"),
            WireBlockRemoved((1, U64), "GPU"),
            WireAllBlocksCleared(),
        ),
        data_parallel_rank=2,
    )


def test_product_decoder_accepts_older_shorter_events() -> None:
    # An older release's BlockStored ends after block_size; its batch has no rank.
    import msgpack

    payload = msgpack.packb([1.0, [["BlockStored", [9], None, [1, 2], 2], ["BlockRemoved", [9]]]])
    assert decode_batch(payload).events == (
        WireBlockStored((9,), None, (1, 2), 2, None),
        WireBlockRemoved((9,), None),
    )


def test_sequence_and_frames() -> None:
    assert encode_sequence(0) == b"\x00" * 8
    assert encode_sequence(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    assert decode_sequence(b"\x00\x00\x00\x00\x00\x00\x01\x02") == 258
    assert decode_sequence(REPLAY_END_SEQ) == -1
    assert REPLAY_END_SEQ == b"\xff" * 8
    assert frames("kv@10.1.2.3@m", 1, b"x") == (b"kv@10.1.2.3@m", b"\x00" * 7 + b"\x01", b"x")


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            BlocksStored((1,), None, (1, 2, 3), 2),
            "token_ids has 3 tokens, expected block_size * len(block_hashes) = 2 * 1",
        ),
        (BlocksStored((), None, (), 2), "BlockStored needs at least one block hash"),
        (BlocksStored((1,), None, (), 0), "block_size must be positive, got 0"),
        (BlocksStored((-1,), None, (1,), 1), "int block hash -1 is outside the unsigned 64-bit range"),
        (BlocksStored((2**64,), None, (1,), 1), "outside the unsigned 64-bit range"),
        (BlocksStored((b"",), None, (1,), 1), "block hash is empty bytes"),
        (BlocksStored(("ab",), None, (1,), 1), "block hash must be int or bytes, got str"),
        (BlocksRemoved(()), "BlockRemoved needs at least one block hash"),
        (object(), "not a KV event record: object"),
    ],
)
def test_bad_records_are_rejected_with_the_reason(record: object, message: str) -> None:
    with pytest.raises(
        WireFormatError, match=message.replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")
    ):
        encode_batch([record], ts=0.0, encoding=ENCODING_ARRAY)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "payload is not valid msgpack"),
        (bytes.fromhex("92cb000000000000000090") + b"\x00", "not valid msgpack"),
        (bytes.fromhex("91cb0000000000000000"), "EventBatch must be an array"),
        (bytes.fromhex("93cb000000000000000091a3466f6f00"), "event must be a tagged array"),
        (bytes.fromhex("93cb00000000000000009191a3466f6f00"), "unknown event tag 'Foo'"),
        (bytes.fromhex("93cb00000000000000009192ab426c6f636b53746f72656401c0"), "BlockStored has 2 elements"),
    ],
)
def test_bad_payloads_are_rejected_with_the_reason(payload: bytes, message: str) -> None:
    with pytest.raises(WireFormatError, match=message):
        decode_batch(payload)


def test_bad_sequence_frame() -> None:
    with pytest.raises(WireFormatError, match="sequence frame must be 8 bytes, got 4"):
        decode_sequence(b"\x00" * 4)
    with pytest.raises(WireFormatError, match="sequence number -1 is outside"):
        encode_sequence(-1)
