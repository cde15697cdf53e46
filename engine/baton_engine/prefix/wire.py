"""vLLM's KV-event wire format (torch-free): Baton's event records in, msgpack bytes out, and back.

Baton follows **vLLM v0.22.0** (``vllm/distributed/kv_events.py``, the format llm-d-kv-cache
v0.8.x decodes). That release encodes with msgspec structs declared ``array_like=True, tag=True,
omit_defaults=True``; for array-like structs msgspec writes every field in declaration order,
``None`` included (``omit_defaults`` only thins map-encoded structs), and the tag is element 0:

* one ZMQ message is three frames: ``[topic, sequence (8-byte big-endian), payload]``;
* payload, ``EventBatch``: ``[ts: float64, events: [...], data_parallel_rank: int | nil]``;
* ``BlockStored``: ``["BlockStored", block_hashes, parent_block_hash | nil, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window]`` — vLLM's block pool fills ``medium="GPU"``, ``group_idx=0``,
  ``extra_keys`` one ``nil`` per block when a block has no extra keys, the rest ``nil``;
* ``BlockRemoved``: ``["BlockRemoved", block_hashes, medium, group_idx]``;
* ``AllBlocksCleared``: ``["AllBlocksCleared"]``.

Block hashes in events are unsigned 64-bit ints: vLLM's default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) turns its 32-byte digests into
``int.from_bytes(digest, "big") & (2**64 - 1)``, i.e. the digest's last 8 bytes. The parent of
a run that starts a sequence is ``nil`` (not the seed hash).

The encoder accepts any objects shaped like Baton's records in ``kv_cache_events``
(``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``), dispatching on those
attribute names, so this module does not depend on the block manager.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from baton_engine.prefix.hashing import to_event_hash

VLLM_RELEASE: Final = "v0.22.0"

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
    """`to_event_hash`, its refusals as `WireFormatError`."""
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


def event_to_wire(record: Any) -> list[Any]:
    """One Baton event record as vLLM's positional event array."""
    if hasattr(record, "token_ids"):
        return _stored_to_wire(record)
    if hasattr(record, "block_hashes"):
        return _removed_to_wire(record)
    if type(record).__name__ == TAG_ALL_BLOCKS_CLEARED:
        return [TAG_ALL_BLOCKS_CLEARED]
    raise WireFormatError(f"not a KV event record: {type(record).__name__}")


def encode_batch(
    records: Iterable[Any], ts: float | None = None, data_parallel_rank: int | None = 0
) -> bytes:
    """The msgpack payload of one EventBatch."""
    events = [event_to_wire(r) for r in records]
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


def _hash_list(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise WireFormatError(f"{where}: block_hashes must be an array, got {type(value).__name__}")
    return tuple(_event_hash(h) for h in value)


def _decode_event(raw: Any) -> WireEvent:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise WireFormatError(f"event must be a tagged array, got {raw!r:.80}")
    tag = raw[0]
    if tag == TAG_BLOCK_STORED:
        # Older releases end after block_size, newer ones append fields: read what is there.
        if len(raw) < 5:
            raise WireFormatError(f"BlockStored has {len(raw)} elements, needs at least 5")
        tokens = raw[3]
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise WireFormatError("BlockStored: token_ids must be an array of ints")
        parent = raw[2]
        return WireBlockStored(
            block_hashes=_hash_list(raw[1], tag),
            parent_block_hash=None if parent is None else _event_hash(parent),
            token_ids=tuple(tokens),
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
    """Parse one EventBatch payload (strict about shape, lenient about trailing fields)."""
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
    return WireBatch(ts=float(ts), events=tuple(_decode_event(e) for e in events), data_parallel_rank=rank)


def frames(topic: str, seq: int, payload: bytes) -> Sequence[bytes]:
    """The three ZMQ frames of one published batch."""
    return (topic.encode("utf-8"), encode_sequence(seq), payload)
