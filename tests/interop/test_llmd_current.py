"""llm-d's current Go indexer code (llm-d-kv-cache v0.9.0's vLLM engine adapter, which reads
vLLM 0.32's map-encoded events) decodes Baton's default KV-event stream exactly as it decodes a
real vLLM's. The decoder program is tests/kv_events/go_decoder built against that release (its
go.mod pins v0.8.1, the array-only reader tests/kv_events checks the array encoding with)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import zmq

from baton_engine.prefix.publisher import KVEventPublisher
from baton_engine.prefix.wire import (
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    decode_batch,
    parse_replay_answer,
)
from baton_support.wait import wait_for
from tests.interop import vllm_peer
from tests.interop.test_vllm_kv_events import as_records, history
from tests.prefix.conftest import CACHE_ROOT, GO_DECODER_SRC

pytestmark = pytest.mark.slow

LLMD_KV_CACHE = "github.com/llm-d/llm-d-kv-cache"
LLMD_VERSION = "v0.9.0"


def _go_env(flags: str) -> dict[str, str]:
    return {
        **os.environ,
        "GOMODCACHE": str(CACHE_ROOT / "gomod"),
        "GOCACHE": str(CACHE_ROOT / "gocache"),
        "GOFLAGS": flags,
        "GOTOOLCHAIN": "local",
        "CGO_ENABLED": "0",
    }


@pytest.fixture(scope="session")
def llmd_decoder() -> Path:
    """The decoder built against llm-d-kv-cache v0.9.0, once per source hash under ~/.cache/baton/."""
    digest = hashlib.sha256(LLMD_VERSION.encode())
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update((GO_DECODER_SRC / name).read_bytes())
    binary = CACHE_ROOT / "go_decoder" / f"llmd-{digest.hexdigest()[:16]}" / "go_decoder"
    if binary.exists():
        return binary
    go = shutil.which("go")
    if go is None:
        pytest.fail("the llm-d decoder check needs the Go toolchain (`go` on PATH)")
    binary.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="baton-llmd-") as tmp:
        src = Path(tmp) / "go_decoder"
        shutil.copytree(GO_DECODER_SRC, src)
        pin = f"-require={LLMD_KV_CACHE}@{LLMD_VERSION}"
        subprocess.run([go, "mod", "edit", pin], cwd=src, env=_go_env(""), check=True, timeout=120)
        # Fetches the release's dependencies through the Go module proxy (cached afterwards).
        subprocess.run([go, "mod", "tidy"], cwd=src, env=_go_env("-mod=mod"), check=True, timeout=900)
        partial = binary.with_suffix(".partial")
        subprocess.run(
            [go, "build", "-o", str(partial), "."],
            cwd=src,
            env=_go_env("-mod=readonly -buildvcs=false"),
            check=True,
            timeout=1500,
        )
    partial.rename(binary)
    return binary


def go_decode(binary: Path, frames: list[tuple[bytes, int, bytes]]) -> list[dict[str, Any]]:
    lines = [
        json.dumps({"topic": t.decode(), "seq_hex": s.to_bytes(8, "big").hex(), "payload_hex": p.hex()})
        for t, s, p in frames
    ]
    done = subprocess.run(
        [str(binary), "-mode", "decode"],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module", params=["sha256", "sha256_cbor"])
def recorded(request: pytest.FixtureRequest) -> dict[str, Any]:
    return vllm_peer.load_fixture(request.param)


def vllm_frames(recorded: dict[str, Any]) -> list[tuple[bytes, int, bytes]]:
    topic = recorded["topic"].encode()
    return [(topic, seq, payload) for seq, payload in history(recorded)]


def test_llmd_reads_the_recorded_vllm_stream_as_baton_does(
    llmd_decoder: Path, recorded: dict[str, Any]
) -> None:
    decoded = go_decode(llmd_decoder, vllm_frames(recorded))
    assert [d["seq"] for d in decoded] == [seq for seq, _ in history(recorded)]
    for ours, theirs in zip((decode_batch(p) for _, p in history(recorded)), decoded, strict=True):
        assert "error" not in theirs and (theirs["pod_id"], theirs["model_name"]) == ("127.0.0.1", "smollm2")
        assert theirs["ts"] == ours.ts
        assert len(theirs["events"]) == len(ours.events)
        for event, seen in zip(ours.events, theirs["events"], strict=True):
            if isinstance(event, WireBlockStored):
                assert seen["type"] == "BlockStored"
                assert seen["event"]["BlockHashes"] == list(event.block_hashes)
                assert seen["event"]["Tokens"] == list(event.token_ids)
                assert seen["event"]["ParentHash"] == (event.parent_block_hash or 0)  # llm-d: nil is 0
            elif isinstance(event, WireBlockRemoved):
                assert (seen["type"], seen["event"]["BlockHashes"]) == (
                    "BlockRemoved",
                    list(event.block_hashes),
                )
            else:
                assert isinstance(event, WireAllBlocksCleared) and seen["type"] == "AllBlocksCleared"


def test_llmd_reads_batons_stream_exactly_as_vllms(llmd_decoder: Path, recorded: dict[str, Any]) -> None:
    """Baton's publisher (default encoding) sends vLLM's recorded events again, with their times;
    llm-d decodes what a subscriber fetches from Baton's replay socket identically."""
    publisher = KVEventPublisher("tcp://127.0.0.1:*", recorded["topic"], replay_endpoint="tcp://127.0.0.1:*")
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        for _, payload in history(recorded):
            batch = decode_batch(payload)
            publisher.publish(as_records(batch), ts=batch.ts)
        dealer.connect(publisher.replay_endpoint or "")
        want = len(history(recorded))

        def replayed() -> list[tuple[bytes, int, bytes]] | None:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            got = []
            while True:
                assert dealer.poll(10_000), "no replay answer"
                message = dealer.recv_multipart()
                seq, payload = parse_replay_answer(message)
                if seq == -1:
                    return got if len(got) == want else None
                got.append((message[1], seq, payload))

        batons = wait_for(replayed, timeout=30, message="every batch in Baton's replay buffer")
    finally:
        dealer.close()
        publisher.shutdown()
        ctx.term()
    assert go_decode(llmd_decoder, batons) == go_decode(llmd_decoder, vllm_frames(recorded))
