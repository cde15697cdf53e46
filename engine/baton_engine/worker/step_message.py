"""The messages between tensor-parallel rank 0 and ranks 1..N-1 (ZMQ over ``ipc://``).

rank 0 -> rank r (its `control` socket; multipart, first frame the kind):

* ``[STEP, header, *arrays]``: one `SchedulerOutput`. The header (msgpack) holds the scalars,
  the lists and each array's name, dtype and shape; the arrays follow as raw frames (sent
  without a copy). The block table is cut to the columns the step's rows read.
* ``[SHUTDOWN]``: leave the loop and exit 0.
* ``[KV, msgpack payload]``: a KV-transfer command for the rank's transfer agent (P/D).

rank r -> rank 0 (one shared `results` socket; one msgpack frame ``[kind, payload]``):
``hello`` {rank, pid} before joining the group, ``ready`` {rank, memory, kv_port} once the
rank's shard and KV cache are in place (kv_port: where a producer rank serves its heads, or
None), ``heartbeat`` {rank} every `HEARTBEAT_S`, ``failed`` {rank, message} before a rank exits
on an error, ``kv`` {rank, kv} from the transfer agent (`kv_transfer.rank_agent`).
"""

from __future__ import annotations

from typing import Any, Final

import msgpack
import numpy as np

from baton_engine.core.scheduler_output import SamplingBatch, SchedulerOutput

STEP: Final = b"step"
SHUTDOWN: Final = b"shutdown"
KV: Final = b"kv"

HELLO: Final = "hello"
READY: Final = "ready"
HEARTBEAT: Final = "heartbeat"
FAILED: Final = "failed"
KV_RESULT: Final = "kv"

HEARTBEAT_S: Final = 0.5

_STEP_ARRAYS = (
    "query_lens",
    "query_start_loc",
    "num_computed_tokens",
    "seq_lens",
    "input_ids",
    "positions",
    "slot_mapping",
    "block_tables",
    "logits_indices",
    "sample_rows",
    "num_draft_tokens",
)
_SAMPLING_ARRAYS = ("temperature", "top_p", "top_k", "seeds", "output_positions", "num_logprobs")


def encode_step(step: SchedulerOutput, block_size: int) -> list[Any]:
    """The frames of a STEP message (arrays are zero-copy views: send before mutating them)."""
    arrays: dict[str, np.ndarray] = {name: getattr(step, name) for name in _STEP_ARRAYS}
    tables = arrays["block_tables"]
    if tables.ndim == 2 and len(step.seq_lens):
        width = int(-(-int(np.max(step.seq_lens)) // block_size))
        arrays["block_tables"] = tables[:, :width]
    for name in _SAMPLING_ARRAYS:
        arrays[f"sampling.{name}"] = getattr(step.sampling, name)
    contiguous = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    header = {
        "step_id": step.step_id,
        "req_ids": list(step.req_ids),
        "num_decode_rows": step.num_decode_rows,
        "num_prefill_tokens": step.num_prefill_tokens,
        "num_decode_tokens": step.num_decode_tokens,
        "finished_req_ids": list(step.finished_req_ids),
        "decode_lookahead": step.decode_lookahead,
        "all_greedy": step.sampling.all_greedy,
        "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in contiguous.items()],
    }
    # Flat byte views (reshape(-1) keeps empty arrays castable), sent without a copy.
    return [
        STEP,
        msgpack.packb(header, use_bin_type=True),
        *(a.reshape(-1).view(np.uint8) for a in contiguous.values()),
    ]


def decode_step(frames: list[Any]) -> SchedulerOutput:
    """The `SchedulerOutput` of a STEP message's frames (after the kind frame)."""
    header = msgpack.unpackb(frames[0], raw=False)
    arrays: dict[str, np.ndarray] = {}
    for (name, dtype, shape), frame in zip(header["arrays"], frames[1:], strict=True):
        arrays[name] = np.frombuffer(frame, dtype=np.dtype(dtype)).reshape(shape).copy()  # writable
    sampling = SamplingBatch(
        **{name: arrays.pop(f"sampling.{name}") for name in _SAMPLING_ARRAYS}, all_greedy=header["all_greedy"]
    )
    return SchedulerOutput(
        step_id=header["step_id"],
        req_ids=header["req_ids"],
        num_decode_rows=header["num_decode_rows"],
        sampling=sampling,
        num_prefill_tokens=header["num_prefill_tokens"],
        num_decode_tokens=header["num_decode_tokens"],
        finished_req_ids=header["finished_req_ids"],
        decode_lookahead=header["decode_lookahead"],
        **arrays,
    )


def encode_kv(command: Any) -> list[Any]:
    """The frames of a KV message (the command for the rank's transfer agent)."""
    return [KV, msgpack.packb(command, use_bin_type=True)]


def encode_result(kind: str, payload: Any) -> bytes:
    data: bytes = msgpack.packb([kind, payload], use_bin_type=True)
    return data


def decode_result(frame: bytes) -> tuple[str, Any]:
    kind, payload = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    return str(kind), payload
