"""The KV-transfer wire protocol (pyzmq, producer ROUTER <-> consumer DEALER over TCP).

Every message is multipart ``[MAGIC, kind, msgpack header]`` with one extra payload frame on
DATA. Consumer -> producer: PULL, DONE, RELEASE. Producer -> consumer: META (then DATA x n), ACK,
ERR. Each reply echoes the consumer's ``pull_id`` so a late reply of an abandoned pull is never
taken for the current one.

    consumer                                  producer
    PULL {pull_id, transfer_id, engine_id,
          block_ids, spec, kv_key}   ---->    checks lease, engine id, KV key, ids, spec
                                     <----    META {pull_id, num_chunks, spec} | ERR
                                     <----    DATA {pull_id, index, first, count} + bytes  (xN)
    (writes each chunk into its own blocks)
    DONE {pull_id, transfer_id}      ---->    releases the lease (blocks freed)
                                     <----    ACK {pull_id} | ERR
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any, Final

import msgpack

from baton_engine import contract

MAGIC: Final = b"BKV1"


class Kind(bytes, enum.Enum):
    PULL = b"PULL"
    DONE = b"DONE"
    RELEASE = b"RELEASE"
    META = b"META"
    DATA = b"DATA"
    ACK = b"ACK"
    ERR = b"ERR"


class FailureReason(enum.StrEnum):
    """Why a pull failed; the `reason` label of the failures metric."""

    UNKNOWN_TRANSFER = "unknown_transfer"  # no lease under that id (never existed or released)
    LEASE_EXPIRED = "lease_expired"
    ENGINE_MISMATCH = "engine_mismatch"  # the producer restarted: a different engine id
    SPEC_MISMATCH = "spec_mismatch"  # block size, dtype, layout or cache shape differ
    BAD_REQUEST = "bad_request"  # malformed message or block ids outside the lease
    PRODUCER_UNREACHABLE = "producer_unreachable"  # connection refused
    PRODUCER_GONE = "producer_gone"  # connection lost during the transfer
    TIMEOUT = "timeout"  # no reply within the receive timeout
    PROTOCOL = "protocol"  # a reply this side did not expect
    CANCELLED = "cancelled"  # the request was aborted (client gone) during its pull
    PROMPT_MISMATCH = "prompt_mismatch"  # the params describe another prompt than the request's
    KV_KEY_MISMATCH = "kv_key_mismatch"  # the engines' KV-compatibility keys differ (see contract)


class KVTransferError(Exception):
    """A pull failed; `reason` says why in a form metrics and policies can use."""

    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class CacheSpec:
    """What must agree between two KV caches for a block to mean the same on both sides."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix (an FP8 cache names its format)
    layout: str = contract.KV_LAYOUT

    @property
    def element_size(self) -> int:
        return _ELEMENT_SIZES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.num_layers * 2 * self.row_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> CacheSpec:
        if not isinstance(raw, dict):
            raise ValueError("spec: must be a map")
        want = {"num_layers": int, "block_size": int, "num_kv_heads": int, "head_dim": int, "dtype": str}
        for name, typ in want.items():
            if not isinstance(raw.get(name), typ):
                raise ValueError(f"spec.{name}: missing or not {typ.__name__}")
        if raw["dtype"] not in _ELEMENT_SIZES:
            raise ValueError(f"spec.dtype: unsupported {raw['dtype']!r}")
        return cls(
            num_layers=raw["num_layers"],
            block_size=raw["block_size"],
            num_kv_heads=raw["num_kv_heads"],
            head_dim=raw["head_dim"],
            dtype=raw["dtype"],
            layout=str(raw.get("layout", contract.KV_LAYOUT)),
        )

    def mismatch(self, other: CacheSpec) -> str | None:
        """A message naming every field that differs (ours vs theirs), or None if they agree."""
        diffs = [
            f"{name} {mine!r} != {theirs!r}"
            for name, mine in asdict(self).items()
            if (theirs := getattr(other, name)) != mine
        ]
        return ", ".join(diffs) if diffs else None


_ELEMENT_SIZES: Final[dict[str, int]] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}


def encode(kind: Kind, header: dict[str, Any]) -> list[bytes]:
    return [MAGIC, kind.value, msgpack.packb(header, use_bin_type=True)]


def decode(frames: list[bytes]) -> tuple[Kind, dict[str, Any]]:
    """Parse ``[MAGIC, kind, header, ...]``; raise ValueError naming what is wrong."""
    if len(frames) < 3:
        raise ValueError(f"expected at least 3 frames, got {len(frames)}")
    if frames[0] != MAGIC:
        raise ValueError(f"bad magic {bytes(frames[0][:8])!r} (expected {MAGIC!r})")
    try:
        kind = Kind(bytes(frames[1]))
    except ValueError:
        raise ValueError(f"unknown message kind {bytes(frames[1][:16])!r}") from None
    try:
        header = msgpack.unpackb(frames[2], raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"undecodable header: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("header: must be a map")
    return kind, header


def block_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Split ``ids`` into maximal runs of consecutive ids: (position in ids, first id, length)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs
