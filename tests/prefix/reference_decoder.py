"""An independent reader of vLLM's KV-event payloads, for tests only.

Written from the msgpack specification and the event layout (not from Baton's encoder, and
without the msgpack library), so an encoder bug is not mirrored here. It also reports the
msgpack *format* of every integer and float, so tests can pin the exact encoding vLLM's
msgspec produces (minimal-width ints, float64 timestamps).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Int:
    value: int
    fmt: str  # "fixint", "uint8", ..., "int64"


@dataclass(frozen=True)
class Float:
    value: float
    fmt: str  # "float32" | "float64"


class Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError(f"truncated msgpack at byte {self.pos} (need {n} more)")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "big")

    def read(self) -> Any:
        b = self.take(1)[0]
        if b <= 0x7F:
            return Int(b, "fixint")
        if b >= 0xE0:
            return Int(b - 0x100, "negfixint")
        if 0x90 <= b <= 0x9F:
            return [self.read() for _ in range(b & 0x0F)]
        if 0x80 <= b <= 0x8F:
            return {self.read(): self.read() for _ in range(b & 0x0F)}
        if 0xA0 <= b <= 0xBF:
            return self.take(b & 0x1F).decode("utf-8")
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b]
        sized = {
            0xCC: ("uint8", 1, False),
            0xCD: ("uint16", 2, False),
            0xCE: ("uint32", 4, False),
            0xCF: ("uint64", 8, False),
            0xD0: ("int8", 1, True),
            0xD1: ("int16", 2, True),
            0xD2: ("int32", 4, True),
            0xD3: ("int64", 8, True),
        }
        if b in sized:
            name, n, signed = sized[b]
            return Int(int.from_bytes(self.take(n), "big", signed=signed), name)
        if b == 0xCA:
            return Float(struct.unpack(">f", self.take(4))[0], "float32")
        if b == 0xCB:
            return Float(struct.unpack(">d", self.take(8))[0], "float64")
        if b in (0xD9, 0xDA, 0xDB):
            return self.take(self.uint({0xD9: 1, 0xDA: 2, 0xDB: 4}[b])).decode("utf-8")
        if b in (0xC4, 0xC5, 0xC6):
            return self.take(self.uint({0xC4: 1, 0xC5: 2, 0xC6: 4}[b]))
        if b in (0xDC, 0xDD):
            return [self.read() for _ in range(self.uint(2 if b == 0xDC else 4))]
        raise ValueError(f"msgpack type byte 0x{b:02x} is not expected in a KV-event payload")


def read_msgpack(data: bytes) -> Any:
    """Decode with type annotations (Int/Float wrappers); the whole input must be consumed."""
    reader = Reader(data)
    value = reader.read()
    if reader.pos != len(data):
        raise ValueError(f"{len(data) - reader.pos} trailing bytes after the payload")
    return value


def plain(value: Any) -> Any:
    """Strip the Int/Float wrappers."""
    if isinstance(value, Int | Float):
        return value.value
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


# Field names per tag, in wire order (vLLM v0.22.0 layout, tag first).
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def decode_event_batch(payload: bytes) -> dict[str, Any]:
    """``{"ts", "events": [{"type", <field>: value, ...}], "data_parallel_rank"}``; checks arity."""
    top = read_msgpack(payload)
    if not isinstance(top, list) or len(top) != 3:
        raise ValueError(f"EventBatch must be a 3-element array, got {top!r:.60}")
    ts, events, rank = top
    if not isinstance(ts, Float) or ts.fmt != "float64":
        raise ValueError(f"ts must be a float64, got {ts!r}")
    decoded = []
    for raw in events:
        tag = raw[0]
        names = EVENT_FIELDS[tag]
        if len(raw) != 1 + len(names):
            raise ValueError(f"{tag} has {len(raw) - 1} fields, vLLM v0.22.0 writes {len(names)}")
        decoded.append({"type": tag, **{n: plain(v) for n, v in zip(names, raw[1:], strict=True)}})
    return {"ts": ts.value, "events": decoded, "data_parallel_rank": plain(rank)}
