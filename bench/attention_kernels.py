"""Time of each Triton paged-attention kernel at the engine's shapes (bf16, one GPU).

``python -m bench.attention_kernels --json``: decode (1 query per row), multi-query decode (a
verify step's window of Q tokens per row) and prefill, on the Llama-3.2-1B (32 heads, 8 kv heads,
64-dim) and Llama-3.1-8B (128-dim) head shapes with random K/V in a shuffled paged cache. Split
counts are the GPU runner's (`decode_num_splits` at a 4096-token max_model_len). Each case is
the median over `--repeats` timings of `--launches` back-to-back launches (microseconds per
launch), with a digest of its output so that two versions of the kernels can be compared bit
for bit on the same inputs (the inputs are seeded).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from baton_engine.model.kernels.triton_attention import (
    DecodeWorkspace,
    decode_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_tiles,
)
from baton_engine.model.kernels.triton_multi_query import multi_query_workspace, paged_multi_query_attention

MAX_MODEL_LEN = 4096
BLOCK_SIZE = 16
HEADS = 32
KV_HEADS = 8
# Where the cases run: the GPU (kernels compiled); the CPU only for --quick without a GPU, where
# Triton's interpreter runs them (TRITON_INTERPRET=1 before triton is imported) in float32.
DEVICE = ["cuda"]
DTYPE = [torch.bfloat16]


def _paged_cache(rows: int, ctx: int, dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = -(-ctx // BLOCK_SIZE)
    cache = torch.randn(2, rows * blocks, BLOCK_SIZE, KV_HEADS, dim, generator=gen, device=DEVICE[0])
    tables = torch.randperm(rows * blocks, generator=gen, device=DEVICE[0]).to(torch.int32).view(rows, blocks)
    return cache.to(DTYPE[0]), tables


def _time_us(fn: Callable[[], torch.Tensor], launches: int, repeats: int) -> float:
    if DEVICE[0] == "cpu":  # interpreted kernels: wall time, only to show the path runs
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(launches):
                fn()
            samples.append((time.perf_counter() - start) * 1e6 / launches)
        return statistics.median(samples)
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(launches):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(samples)


def _digest(out: torch.Tensor) -> str:
    return hashlib.sha256(out.float().cpu().numpy().tobytes()).hexdigest()[:16]


def decode_case(batch: int, ctx: int, dim: int, seed: int) -> tuple[Callable[[], torch.Tensor], int]:
    gen = torch.Generator(device=DEVICE[0]).manual_seed(seed)
    cache, tables = _paged_cache(batch, ctx, dim, gen)
    q = torch.randn(batch, HEADS, dim, generator=gen, device=DEVICE[0]).to(DTYPE[0])
    lens = torch.full((batch,), ctx, device=DEVICE[0], dtype=torch.int32)
    splits = decode_num_splits(batch, KV_HEADS, MAX_MODEL_LEN)
    ws = DecodeWorkspace(batch, HEADS, dim, splits, torch.device(DEVICE[0]))
    out = torch.empty_like(q)
    return lambda: paged_decode_attention(q, cache, tables, lens, dim**-0.5, ws, out=out), splits


def multi_query_case(
    batch: int, query_len: int, ctx: int, dim: int, seed: int
) -> tuple[Callable[[], torch.Tensor], int]:
    gen = torch.Generator(device=DEVICE[0]).manual_seed(seed)
    cache, tables = _paged_cache(batch, ctx, dim, gen)
    q = torch.randn(batch * query_len, HEADS, dim, generator=gen, device=DEVICE[0]).to(DTYPE[0])
    lens = torch.full((batch,), ctx, device=DEVICE[0], dtype=torch.int32)
    # Rows carry 1..query_len real tokens, like a verify step whose rows drafted different counts.
    query_lens = (torch.arange(batch, device=DEVICE[0], dtype=torch.int32) % query_len) + 1
    splits = decode_num_splits(batch, KV_HEADS, MAX_MODEL_LEN)
    ws = multi_query_workspace(batch, query_len, HEADS, dim, splits, torch.device(DEVICE[0]))
    out = torch.empty_like(q)
    return (
        lambda: paged_multi_query_attention(
            q, cache, tables, lens, query_lens, query_len, dim**-0.5, ws, out=out
        ),
        splits,
    )


def prefill_case(rows: int, length: int, dim: int, seed: int) -> Callable[[], torch.Tensor]:
    gen = torch.Generator(device=DEVICE[0]).manual_seed(seed)
    cache, tables = _paged_cache(rows, length, dim, gen)
    q = torch.randn(rows * length, HEADS, dim, generator=gen, device=DEVICE[0]).to(DTYPE[0])
    starts = torch.arange(0, (rows + 1) * length, length, device=DEVICE[0], dtype=torch.int32)
    lens = torch.full((rows,), length, device=DEVICE[0], dtype=torch.int32)
    tile_rows, tile_starts = (
        torch.tensor(v, device=DEVICE[0], dtype=torch.int32) for v in prefill_tiles([length] * rows)
    )
    out = torch.empty_like(q)
    return lambda: paged_prefill_attention(
        q, cache, tables, starts, lens, tile_rows, tile_starts, dim**-0.5, out=out
    )


def quick_cases() -> dict[str, tuple[Callable[[], torch.Tensor], int]]:
    """One small case of each kernel (the decodes split their keys, as at batch 1 in the engine)."""
    return {
        "decode_1b_b1_ctx40": decode_case(1, 40, 64, 1),
        "mq_1b_b1_q2_ctx40": multi_query_case(1, 2, 40, 64, 5),
        "prefill_1b_1x24": (prefill_case(1, 24, 64, 9), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one tiny case per kernel, 1 x 1 launch: a smoke run (on the CPU through Triton's "
        "interpreter, in float32, when there is no GPU and TRITON_INTERPRET=1)",
    )
    args = parser.parse_args()
    import triton

    import baton_engine

    if args.quick:
        args.launches, args.repeats = 1, 1
        if not torch.cuda.is_available():
            if os.environ.get("TRITON_INTERPRET") != "1":
                parser.error("--quick without a GPU needs TRITON_INTERPRET=1 (Triton's interpreter)")
            DEVICE[0], DTYPE[0] = "cpu", torch.float32
    cases: dict[str, tuple[Callable[[], torch.Tensor], int]] = (
        quick_cases()
        if args.quick
        else {
            "decode_1b_b256_ctx640": decode_case(256, 640, 64, 1),
            "decode_1b_b8_ctx512": decode_case(8, 512, 64, 2),
            "decode_8b_b1_ctx512": decode_case(1, 512, 128, 3),
            "decode_8b_b32_ctx1024": decode_case(32, 1024, 128, 4),
            "mq_1b_b8_q9_ctx512": multi_query_case(8, 9, 512, 64, 5),
            "mq_1b_b64_q5_ctx512": multi_query_case(64, 5, 512, 64, 6),
            "mq_1b_b256_q3_ctx512": multi_query_case(256, 3, 512, 64, 7),
            "mq_8b_b8_q9_ctx512": multi_query_case(8, 9, 512, 128, 8),
            "prefill_1b_32x512": (prefill_case(32, 512, 64, 9), 1),
            "prefill_8b_32x512": (prefill_case(32, 512, 128, 10), 1),
        }
    )
    result: dict[str, Any] = {
        "bench": "attention_kernels",
        "quick": args.quick,
        "gpu": torch.cuda.get_device_name() if DEVICE[0] == "cuda" else None,
        "device": DEVICE[0],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "engine_path": baton_engine.__path__[0],
        "launches": args.launches,
        "repeats": args.repeats,
        "us": {},
        "splits": {},
        "digest": {},
    }
    for name, (fn, splits) in cases.items():
        result["us"][name] = round(_time_us(fn, args.launches, args.repeats), 2)
        result["splits"][name] = splits
        result["digest"][name] = _digest(fn())
        if not args.json:
            print(name, result["us"][name], "us", f"splits={splits}", flush=True)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
