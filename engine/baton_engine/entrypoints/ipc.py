"""The wire between the HTTP server process and the engine-core process.

Two ZMQ PUSH/PULL pairs over ``ipc://`` sockets in a private temp directory; the server binds
both (it outlives the core), the core connects. Every message is one msgpack frame
``[kind, payload]``:

server -> core (`input` socket)
    ``["add", [request_id, prompt_token_ids, sampling_params_dict, arrival_time]]``
    ``["abort", [[request_id, ...], message]]``
    ``["utility", [call_id, method, args]]`` -- methods: ``stats``, ``reset_prefix_cache``
    ``["shutdown", None]``

core -> server (`output` socket)
    ``["ready", {"num_kv_blocks", "max_model_len", "block_size", "pid", "model_name", "eos_token_ids",
      "vocab_size"}]``
    ``["failed", "message"]`` -- loading failed; the core exits
    ``["fatal", "message"]`` -- a tensor-parallel rank died or hung; the core exits at once and
      the server stops too (exit code 1: the pod restarts rather than limp on)
    ``["outputs", [[RequestOutput.to_wire(), ...], EngineStats dict]]`` -- once per step with
      outputs, and once more when the core goes idle (so gauges fall back to 0)
    ``["utility_result", [call_id, ok, result_or_error_message]]``

msgpack rather than pickle: the payloads are plain lists/dicts, and a peer can never make the
other side execute code.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

ADD = "add"
ABORT = "abort"
UTILITY = "utility"
SHUTDOWN = "shutdown"
READY = "ready"
FAILED = "failed"
FATAL = "fatal"
OUTPUTS = "outputs"
UTILITY_RESULT = "utility_result"


def encode(kind: str, payload: Any) -> bytes:
    data: bytes = msgpack.packb([kind, payload], use_bin_type=True)
    return data


def decode(frame: bytes) -> tuple[str, Any]:
    kind, payload = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    return str(kind), payload


@dataclass(frozen=True)
class IpcPaths:
    """Socket addresses in a private directory (removed by `cleanup`)."""

    directory: Path

    @classmethod
    def create(cls) -> IpcPaths:
        return cls(Path(tempfile.mkdtemp(prefix="baton-ipc-")))

    @property
    def input_address(self) -> str:
        return f"ipc://{self.directory / 'input.sock'}"

    @property
    def output_address(self) -> str:
        return f"ipc://{self.directory / 'output.sock'}"

    def cleanup(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
