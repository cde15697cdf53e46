"""KV-transfer throughput against a plain TCP socket, two processes on this machine.

Cases: the KV of a 4096-token SmolLM2-135M prompt (30 layers, 3 KV heads, head_dim 64, float32,
block 16: 256 blocks of 720 KiB, 180 MiB) and 64 MiB of the same blocks (91 blocks). The
producer's and the consumer's block ids are random permutations (the worst case for the
gather/scatter: no two requested blocks are adjacent).

Timed: Baton's pull, from the PULL request (connection included) until every block is written
into the consumer's own cache and the producer acknowledged DONE (prefill is not part of it).
Raw: a Python `socket` receiver connects, sends a 1-byte request, the sender `sendall`s the same
number of bytes from one contiguous buffer, the receiver `recv_into`s a preallocated buffer,
sends a 1-byte done and waits for the 1-byte acknowledgement. Producer and sender run in child
processes; runs alternate between the two (after one warm-up round, which also checks that the
consumer's blocks equal the producer's). Each case reports the fastest and the median of
`--repeats` runs for both; the machine is shared, so the fastest run is the least disturbed one
and the rates and ratios come from it (``*_median`` fields give the medians).
``ratio_vs_raw_tcp`` is the lower of the two cases' ratios (rate / raw rate).

Run: ``python -m bench.kv_transfer --json``. ``--device cuda`` puts both KV caches on the GPU
(the producer stages through pinned host buffers).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import socket
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import zmq

from baton_engine.kv_transfer.cache_blocks import cache_spec
from baton_engine.kv_transfer.consumer import KVTransferConsumer
from baton_engine.kv_transfer.params import sign_params, verify_params
from baton_engine.kv_transfer.producer import KVTransferProducer

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
BLOCK_BYTES = LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4
CASES = {
    "smollm2_4k_tokens": 4096 // BLOCK_SIZE,
    "64MiB": (64 << 20) // BLOCK_BYTES,
}
QUICK_CASES = {"smollm2_256_tokens": 256 // BLOCK_SIZE}
CACHE_BLOCKS = 320
KEY = b"bench-key"


def _make_cache(device: str, seed: int, fill: bool) -> torch.Tensor:
    shape = (LAYERS, 2, CACHE_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if not fill:
        return torch.zeros(shape, device=device)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device)


def _producer_main(conn: Connection, device: str, chunk_bytes: int) -> None:
    kv = _make_cache(device, seed=1, fill=True)
    producer = KVTransferProducer(kv, engine_id="bench-producer", port=0, chunk_bytes=chunk_bytes)
    conn.send(producer.port)
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "lease":
            producer.add_lease(msg[1], msg[2], 60.0)
            conn.send("ok")
        elif msg[0] == "ended":
            conn.send(producer.take_ended())
        elif msg[0] == "blocks":
            conn.send(kv[:, :, msg[1]].cpu().numpy().tobytes())
    producer.close()


def _raw_sender_main(conn: Connection, max_bytes: int) -> None:
    payload = np.random.default_rng(2).integers(0, 255, size=max_bytes, dtype=np.uint8)
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    view = memoryview(payload)
    while True:
        peer, _ = server.accept()
        with peer:
            request = peer.recv(8)
            if request == b"":
                break  # the stop connection
            nbytes = int.from_bytes(request, "big")
            peer.sendall(view[:nbytes])
            if peer.recv(1) == b"D":
                peer.sendall(b"A")
    server.close()


def _raw_receive(port: int, buffer: memoryview) -> float:
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(len(buffer).to_bytes(8, "big"))
        got = 0
        while got < len(buffer):
            n = sock.recv_into(buffer[got:])
            if n == 0:
                raise RuntimeError("raw sender closed early")
            got += n
        sock.sendall(b"D")
        if sock.recv(1) != b"A":
            raise RuntimeError("raw sender did not acknowledge")
    return time.perf_counter() - started


def run(repeats: int, device: str, chunk_bytes: int, cases: dict[str, int] = CASES) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    prod_conn, prod_child = ctx.Pipe()
    raw_conn, raw_child = ctx.Pipe()
    max_bytes = max(cases.values()) * BLOCK_BYTES
    producer = ctx.Process(target=_producer_main, args=(prod_child, device, chunk_bytes), daemon=True)
    sender = ctx.Process(target=_raw_sender_main, args=(raw_child, max_bytes), daemon=True)
    producer.start()
    sender.start()
    kv_port, raw_port = prod_conn.recv(), raw_conn.recv()
    kv = _make_cache(device, seed=0, fill=False)
    spec = cache_spec(kv)
    consumer = KVTransferConsumer(kv, timeout_s=30.0)
    raw_buffer = memoryview(bytearray(max_bytes))
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {}
    try:
        for name, num_blocks in cases.items():
            nbytes = num_blocks * BLOCK_BYTES
            ours: list[float] = []
            raw: list[float] = []
            for attempt in range(repeats + 1):  # the first round warms both paths up
                src = [int(b) for b in rng.permutation(CACHE_BLOCKS)[:num_blocks]]
                dst = [int(b) for b in rng.permutation(CACHE_BLOCKS)[:num_blocks]]
                transfer_id = f"{name}-{attempt}"
                prod_conn.send(("lease", transfer_id, src))
                prod_conn.recv()
                params = verify_params(
                    sign_params(
                        key=KEY,
                        engine_id="bench-producer",
                        host="127.0.0.1",
                        port=kv_port,
                        transfer_id=transfer_id,
                        block_ids=src,
                        num_tokens=num_blocks * BLOCK_SIZE,
                        first_token=0,
                        spec=spec,
                        model="bench",
                        lease_expires_at=0.0,
                    ),
                    KEY,
                )
                result = consumer.pull(params, dst)
                raw_seconds = _raw_receive(raw_port, raw_buffer[:nbytes])
                if attempt == 0:
                    prod_conn.send(("blocks", src))
                    expected = prod_conn.recv()
                    if kv[:, :, dst].cpu().numpy().tobytes() != expected:
                        raise RuntimeError(f"{name}: consumer blocks differ from the producer's")
                    continue
                ours.append(result.seconds)
                raw.append(raw_seconds)
            ours_rate, raw_rate = nbytes / min(ours) / 1e9, nbytes / min(raw) / 1e9
            ours_median, raw_median = statistics.median(ours), statistics.median(raw)
            results[name] = {
                "bytes": nbytes,
                "blocks": num_blocks,
                "baton_gb_per_s": round(ours_rate, 3),
                "raw_tcp_gb_per_s": round(raw_rate, 3),
                "ratio": round(ours_rate / raw_rate, 3),
                "baton_seconds_min": round(min(ours), 5),
                "raw_tcp_seconds_min": round(min(raw), 5),
                "baton_seconds_median": round(ours_median, 5),
                "raw_tcp_seconds_median": round(raw_median, 5),
                "ratio_median": round(raw_median / ours_median, 3),
            }
        prod_conn.send(("ended",))
        ended = prod_conn.recv()
        if len(ended) != (repeats + 1) * len(cases):
            raise RuntimeError(f"producer ended {len(ended)} leases, expected {(repeats + 1) * len(cases)}")
    finally:
        prod_conn.send(("stop",))
        with socket.create_connection(("127.0.0.1", raw_port)):
            pass
        producer.join(timeout=10)
        sender.join(timeout=10)
        for proc in (producer, sender):
            if proc.is_alive():
                proc.kill()
    return {
        "bench": "kv_transfer",
        "device": device,
        "repeats": repeats,
        "chunk_bytes": chunk_bytes,
        "cases": results,
        "ratio_vs_raw_tcp": min(case["ratio"] for case in results.values()),
        "ratio_vs_raw_tcp_median": min(case["ratio_median"] for case in results.values()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunk-bytes", type=int, default=4 << 20)
    parser.add_argument("--quick", action="store_true", help="one 256-token case, 2 runs: a smoke run")
    args = parser.parse_args()
    if args.quick:
        result = {**run(2, args.device, args.chunk_bytes, QUICK_CASES), "quick": True}
    else:
        result = {**run(args.repeats, args.device, args.chunk_bytes), "quick": False}
    if args.json:
        print(json.dumps(result))
    else:
        for name, case in result["cases"].items():
            print(
                f"{name}: baton {case['baton_gb_per_s']} GB/s, raw {case['raw_tcp_gb_per_s']} GB/s, "
                f"ratio {case['ratio']}"
            )
        print(f"ratio_vs_raw_tcp {result['ratio_vs_raw_tcp']}")


if __name__ == "__main__":
    main()
