"""vLLM's KV-event wire format (torch-free): Baton's event records in, msgpack bytes out, and back.

One ZMQ message is three frames: ``[topic, sequence (8-byte big-endian), payload]``; the payload
is an ``EventBatch``, ``[ts: float64, events: [...], data_parallel_rank: int | nil]``. vLLM has
encoded the events two ways, and both are read (detected per batch):

* **map** (vLLM 0.32, ``KVCACHE_EVENT_ENCODINGS[0]``, what Baton publishes by default): each event
  a msgpack map tagged ``"type"``, its fields in declaration order, optional fields left out when
  null (msgspec ``tag=True, omit_defaults=True``): ``{"type": "BlockStored", "block_hashes": [...],
  "parent_block_hash": h | nil, "token_ids": [...], "block_size": n, "lora_id": nil,
  "medium": "GPU", "lora_name": nil, "extra_keys": [nil per block], "group_idx": 0,
  "kv_cache_spec_kind": "full_attention"}``, ``{"type": "BlockRemoved",
  "block_hashes": [...], "medium": "GPU", "group_idx": 0}``, ``{"type": "AllBlocksCleared"}``;
* **array** (vLLM v0.22 and the indexers of its time, e.g. llm-d-kv-cache v0.8): each event a
  positional array, tag first, every field written: ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
  kv_cache_spec_kind, kv_cache_spec_sliding_window]`` (``extra_keys`` one nil per block),
  ``["BlockRemoved", block_hashes, medium, group_idx]``, ``["AllBlocksCleared"]``.

Replays (a DEALER sends ``[b"", start sequence]`` to the publisher's ROUTER) are answered per
batch with ``[b"", topic, seq, payload]`` and ended by ``[b"", b"", -1, b""]`` in vLLM 0.32,
``[b"", seq, payload]`` and ``[b"", -1, b""]`` before; both are read.

Block hashes in events are unsigned 64-bit ints: vLLM's default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) turns its 32-byte digests into
``int.from_bytes(digest, "big") & (2**64 - 1)``, i.e. the digest's last 8 bytes; digests sent as
bytes are folded the same way on reading. The parent of a run that starts a sequence is ``nil``.

The encoder accepts any objects shaped like Baton's records in ``prefix.events``
(``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``), dispatching on those
attribute names, so this module does not depend on the KV-cache manager.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from baton_engine.prefix.hashing import to_event_hash

#: The vLLM releases whose formats these are (see the module docstring).
VLLM_RELEASE: Final = "0.32"
VLLM_ARRAY_RELEASE: Final = "v0.22.0"

ENCODING_MAP: Final = "map"
ENCODING_ARRAY: Final = "array"
#: Event encodings, current first (the publisher's default).
KV_EVENT_ENCODINGS: Final[tuple[str, ...]] = (ENCODING_MAP, ENCODING_ARRAY)

TAG_BLOCK_STORED: Final = "BlockStored"
TAG_BLOCK_REMOVED: Final = "BlockRemoved"
TAG_ALL_BLOCKS_CLEARED: Final = "AllBlocksCleared"

#: The device-tier label vLLM's block pool puts on its own KV blocks (Baton's main KV pool).
MEDIUM_GPU: Final = "GPU"
#: Baton has one KV-cache group (full attention), vLLM's group 0.
GROUP_IDX: Final = 0

#: Replay protocol: the end-of-replay marker's sequence frame is -1 as a signed 8-byte int.
REPLAY_END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)

_UINT64_MASK: Final = (1 << 64) - 1
_BLOCK_STORED_FIELDS: Final = 12  # tag + 11 fields
_BLOCK_REMOVED_FIELDS: Final = 4  # tag + 3 fields


class WireFormatError(ValueError):
    """Bytes or records that do not fit vLLM's KV-event format."""


def _event_hash(block_hash: Any) -> int:
    """`hashing.to_event_hash`, its refusals as `WireFormatError`."""
    try:
        return to_event_hash(block_hash)
    except ValueError as exc:
        raise WireFormatError(str(exc)) from None


def encode_sequence(seq: int) -> bytes:
    """The sequence frame: unsigned 8-byte big-endian."""
    if not 0 <= seq <= _UINT64_MASK:
        raise WireFormatError(f"sequence number {seq} is outside the unsigned 64-bit range")
    return seq.to_bytes(8, "big")


def decode_sequence(frame: bytes) -> int:
    """Read a sequence frame; -1 (the replay end marker) comes back as -1."""
    if len(frame) != 8:
        raise WireFormatError(f"sequence frame must be 8 bytes, got {len(frame)}")
    if frame == REPLAY_END_SEQ:
        return -1
    return int.from_bytes(frame, "big")


def _stored_to_wire(record: Any) -> list[Any]:
    hashes = [_event_hash(h) for h in record.block_hashes]
    token_ids = [int(t) for t in record.token_ids]
    block_size = int(record.block_size)
    if block_size <= 0:
        raise WireFormatError(f"block_size must be positive, got {block_size}")
    if not hashes:
        raise WireFormatError("BlockStored needs at least one block hash")
    if len(token_ids) != block_size * len(hashes):
        raise WireFormatError(
            f"BlockStored token_ids has {len(token_ids)} tokens, expected block_size * "
            f"len(block_hashes) = {block_size} * {len(hashes)}"
        )
    parent = record.parent_block_hash
    return [
        TAG_BLOCK_STORED,
        hashes,
        None if parent is None else _event_hash(parent),
        token_ids,
        block_size,
        None,  # lora_id
        MEDIUM_GPU,
        None,  # lora_name
        [None] * len(hashes),  # extra_keys: none per block
        GROUP_IDX,
        None,  # kv_cache_spec_kind (vLLM v0.22.0's block pool leaves it unset)
        None,  # kv_cache_spec_sliding_window
    ]


def _removed_to_wire(record: Any) -> list[Any]:
    hashes = [_event_hash(h) for h in record.block_hashes]
    if not hashes:
        raise WireFormatError("BlockRemoved needs at least one block hash")
    return [TAG_BLOCK_REMOVED, hashes, MEDIUM_GPU, GROUP_IDX]


#: What vLLM 0.32's block pool says of its (full-attention) KV-cache group in map-encoded events.
KV_CACHE_SPEC_KIND: Final = "full_attention"


def _as_map(array: list[Any]) -> dict[str, Any]:
    """vLLM 0.32's map form of an array-form event: tag under "type", then the fields in
    declaration order, those with defaults left out when null (msgspec's omit_defaults)."""
    tag = array[0]
    if tag == TAG_BLOCK_STORED:
        fields = (
            "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
            "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        )  # fmt: skip
        out: dict[str, Any] = {"type": tag, **dict(zip(fields, array[1:], strict=False))}
        out["kv_cache_spec_kind"] = KV_CACHE_SPEC_KIND  # vLLM 0.32 names the group's kind
        return out
    if tag == TAG_BLOCK_REMOVED:
        return {"type": tag, "block_hashes": array[1], "medium": array[2], "group_idx": array[3]}
    return {"type": tag}


def event_to_wire(record: Any, encoding: str = ENCODING_MAP) -> list[Any] | dict[str, Any]:
    """One Baton event record as a vLLM event: a map (vLLM 0.32) or a positional array."""
    if hasattr(record, "token_ids"):
        array = _stored_to_wire(record)
    elif hasattr(record, "block_hashes"):
        array = _removed_to_wire(record)
    elif type(record).__name__ == TAG_ALL_BLOCKS_CLEARED:
        array = [TAG_ALL_BLOCKS_CLEARED]
    else:
        raise WireFormatError(f"not a KV event record: {type(record).__name__}")
    if encoding == ENCODING_ARRAY:
        return array
    if encoding == ENCODING_MAP:
        return _as_map(array)
    raise WireFormatError(f"unknown KV event encoding {encoding!r} (one of {', '.join(KV_EVENT_ENCODINGS)})")


def encode_batch(
    records: Iterable[Any],
    ts: float | None = None,
    data_parallel_rank: int | None = 0,
    encoding: str = ENCODING_MAP,
) -> bytes:
    """The msgpack payload of one EventBatch, its events in `encoding`."""
    events = [event_to_wire(r, encoding) for r in records]
    stamp = time.time() if ts is None else float(ts)
    payload: bytes = msgpack.packb([stamp, events, data_parallel_rank], use_bin_type=True)
    return payload


# ----------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class WireBlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None


@dataclass(frozen=True)
class WireBlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None


@dataclass(frozen=True)
class WireAllBlocksCleared:
    pass


WireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


@dataclass(frozen=True)
class WireBatch:
    ts: float
    events: tuple[WireEvent, ...]
    data_parallel_rank: int | None
    encoding: str = ENCODING_ARRAY  # how its events were encoded (KV_EVENT_ENCODINGS)


def _hash_list(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise WireFormatError(f"{where}: block_hashes must be an array, got {type(value).__name__}")
    return tuple(_event_hash(h) for h in value)


def _token_ids(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise WireFormatError(f"{where}: token_ids must be an array of ints")
    return tuple(value)


def _decode_map_event(raw: dict[Any, Any]) -> WireEvent:
    tag = raw.get("type")
    if tag == TAG_BLOCK_STORED:
        missing = [k for k in ("block_hashes", "token_ids", "block_size") if k not in raw]
        if missing:
            raise WireFormatError(f"BlockStored map lacks {', '.join(missing)}")
        parent = raw.get("parent_block_hash")
        size = raw["block_size"]
        if not isinstance(size, int) or isinstance(size, bool):
            raise WireFormatError("BlockStored: block_size must be an int")
        return WireBlockStored(
            block_hashes=_hash_list(raw["block_hashes"], tag),
            parent_block_hash=None if parent is None else _event_hash(parent),
            token_ids=_token_ids(raw["token_ids"], tag),
            block_size=size,
            medium=raw.get("medium"),
        )
    if tag == TAG_BLOCK_REMOVED:
        if "block_hashes" not in raw:
            raise WireFormatError("BlockRemoved map lacks block_hashes")
        return WireBlockRemoved(block_hashes=_hash_list(raw["block_hashes"], tag), medium=raw.get("medium"))
    if tag == TAG_ALL_BLOCKS_CLEARED:
        return WireAllBlocksCleared()
    raise WireFormatError(f"unknown event type {tag!r}")


def _decode_event(raw: Any) -> WireEvent:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise WireFormatError(f"event must be a tagged array, got {raw!r:.80}")
    tag = raw[0]
    if tag == TAG_BLOCK_STORED:
        # Older releases end after block_size, newer ones append fields: read what is there.
        if len(raw) < 5:
            raise WireFormatError(f"BlockStored has {len(raw)} elements, needs at least 5")
        parent = raw[2]
        return WireBlockStored(
            block_hashes=_hash_list(raw[1], tag),
            parent_block_hash=None if parent is None else _event_hash(parent),
            token_ids=_token_ids(raw[3], tag),
            block_size=int(raw[4]),
            medium=raw[6] if len(raw) > 6 else None,
        )
    if tag == TAG_BLOCK_REMOVED:
        if len(raw) < 2:
            raise WireFormatError(f"BlockRemoved has {len(raw)} elements, needs at least 2")
        return WireBlockRemoved(block_hashes=_hash_list(raw[1], tag), medium=raw[2] if len(raw) > 2 else None)
    if tag == TAG_ALL_BLOCKS_CLEARED:
        return WireAllBlocksCleared()
    raise WireFormatError(f"unknown event tag {tag!r}")


def decode_batch(payload: bytes) -> WireBatch:
    """Parse one EventBatch payload, its events maps or arrays (strict about shape, lenient about
    fields a later release adds)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireFormatError(f"payload is not valid msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise WireFormatError("EventBatch must be an array [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    if not isinstance(ts, float | int) or not isinstance(events, list):
        raise WireFormatError("EventBatch: ts must be a number and events an array")
    rank = raw[2] if len(raw) == 3 else None
    if all(isinstance(e, dict) for e in events) and events:
        return WireBatch(float(ts), tuple(_decode_map_event(e) for e in events), rank, ENCODING_MAP)
    if any(isinstance(e, dict) for e in events):
        raise WireFormatError("EventBatch mixes map- and array-encoded events")
    return WireBatch(float(ts), tuple(_decode_event(e) for e in events), rank, ENCODING_ARRAY)


def frames(topic: str, seq: int, payload: bytes) -> Sequence[bytes]:
    """The three ZMQ frames of one published batch."""
    return (topic.encode("utf-8"), encode_sequence(seq), payload)


#: Replay framings: vLLM 0.32's four frames (with the topic), the older three.
REPLAY_WITH_TOPIC: Final = "with-topic"
REPLAY_WITHOUT_TOPIC: Final = "without-topic"
#: The framing each event encoding's vLLM release answers replays with.
REPLAY_FRAMING_OF: Final[dict[str, str]] = {
    ENCODING_MAP: REPLAY_WITH_TOPIC,
    ENCODING_ARRAY: REPLAY_WITHOUT_TOPIC,
}


def replay_answer(topic: bytes, seq: int, payload: bytes, framing: str) -> tuple[bytes, ...]:
    """One replayed batch as the DEALER receives it (after the ROUTER's client id)."""
    if framing == REPLAY_WITH_TOPIC:
        return (b"", topic, encode_sequence(seq), payload)
    return (b"", encode_sequence(seq), payload)


def replay_end(framing: str) -> tuple[bytes, ...]:
    """The end-of-replay marker as the DEALER receives it."""
    if framing == REPLAY_WITH_TOPIC:
        return (b"", b"", REPLAY_END_SEQ, b"")
    return (b"", REPLAY_END_SEQ, b"")


def parse_replay_answer(message: Sequence[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of one replay answer in either framing; seq -1 is the end marker."""
    if len(message) == 4 and message[0] == b"":
        seq = decode_sequence(message[2])
        if seq == -1 and message[1]:
            raise WireFormatError("replay end marker carries a topic")
        return seq, message[3]
    if len(message) == 3 and message[0] == b"":
        return decode_sequence(message[1]), message[2]
    raise WireFormatError(
        f"replay answer must be [b'', topic, seq, payload] or [b'', seq, payload], got {len(message)} frames"
    )
