"""Launch-parameter sweep of the Triton attention kernels (1B and 8B head shapes, bf16).

``python -m bench.gpu_tune --json``: median time of each (BLOCK_N, warps, stages) for decode at
batch 256 / 640 context and batch 1 / 512 context, and for prefill of 32 x 512 fresh tokens. The
defaults in `baton_engine.model.kernels.triton_attention` were picked from its output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from typing import Any

import torch

from baton_engine.model.kernels.triton_attention import (
    DecodeWorkspace,
    decode_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_tiles,
)
from bench.gpu import cuda_time_ms


def _decode_case(batch: int, ctx: int, kv_heads: int, dim: int) -> dict[str, Any]:
    heads, bs = 32, 16
    blocks = -(-ctx // bs)
    cache = torch.randn(2, batch * blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    ws = DecodeWorkspace(batch, heads, dim, decode_num_splits(batch, kv_heads, ctx), torch.device("cuda"))
    ref = paged_decode_attention(q, cache, tables, lens, dim**-0.5, ws).float()
    rows = {}
    for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
        try:
            out = paged_decode_attention(
                q, cache, tables, lens, dim**-0.5, ws, block_n=block_n, num_warps=warps, num_stages=stages
            )
            err = float((out.float() - ref).norm() / ref.norm())
            ms = statistics.median(
                cuda_time_ms(
                    lambda b=block_n, w=warps, s=stages: paged_decode_attention(
                        q, cache, tables, lens, dim**-0.5, ws, block_n=b, num_warps=w, num_stages=s
                    ),
                    15,
                )
            )
            rows[f"n{block_n}_w{warps}_s{stages}"] = (round(ms, 4), round(err, 5))
        except Exception as exc:  # a config that does not compile is reported, not fatal
            rows[f"n{block_n}_w{warps}_s{stages}"] = repr(exc)[:80]
    kv_bytes = batch * ctx * 2 * kv_heads * dim * 2
    timed = {k: v for k, v in rows.items() if isinstance(v, tuple)}
    best = min(timed, key=lambda k: timed[k][0])
    return {
        "best": best,
        "best_ms": timed[best][0],
        "best_gbps": round(kv_bytes / timed[best][0] / 1e6, 1),
        "all": rows,
    }


def _prefill_case(dim: int, kv_heads: int) -> dict[str, Any]:
    heads, bs, n, length = 32, 16, 32, 512
    pblocks = length // bs
    cache = torch.randn(2, n * pblocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(n * length, heads, dim, device="cuda", dtype=torch.bfloat16)
    tables = torch.arange(n * pblocks, device="cuda", dtype=torch.int32).view(n, pblocks)
    starts = torch.arange(0, (n + 1) * length, length, device="cuda", dtype=torch.int32)
    lens = torch.full((n,), length, device="cuda", dtype=torch.int32)
    rows_, offs = prefill_tiles([length] * n)
    tr = torch.tensor(rows_, device="cuda", dtype=torch.int32)
    ts = torch.tensor(offs, device="cuda", dtype=torch.int32)
    rows = {}
    for block_n, warps, stages in itertools.product((32, 64), (4, 8), (2, 3)):
        try:
            ms = statistics.median(
                cuda_time_ms(
                    lambda b=block_n, w=warps, s=stages: paged_prefill_attention(
                        q,
                        cache,
                        tables,
                        starts,
                        lens,
                        tr,
                        ts,
                        dim**-0.5,
                        block_n=b,
                        num_warps=w,
                        num_stages=s,
                    ),
                    15,
                )
            )
            rows[f"n{block_n}_w{warps}_s{stages}"] = round(ms, 4)
        except Exception as exc:
            rows[f"n{block_n}_w{warps}_s{stages}"] = repr(exc)[:80]
    timed = {k: v for k, v in rows.items() if isinstance(v, float)}
    best = min(timed, key=lambda k: timed[k])
    return {"best": best, "best_ms": timed[best], "all": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one decode case at batch 8 (a smoke run; needs a GPU like the rest)",
    )
    args = parser.parse_args()
    if args.quick:
        cases = {"decode_1b_b8_ctx128": _decode_case(8, 128, 8, 64)}
    else:
        cases = {
            "decode_1b_b256_ctx640": _decode_case(256, 640, 8, 64),
            "decode_8b_b1_ctx512": _decode_case(1, 512, 8, 128),
            "decode_8b_b32_ctx1024": _decode_case(32, 1024, 8, 128),
            "prefill_1b": _prefill_case(64, 8),
            "prefill_8b": _prefill_case(128, 8),
        }
    for name, case in cases.items():
        print(name, case["best"], case["best_ms"], case.get("best_gbps", ""), flush=True)
    print(json.dumps({"bench": "gpu_tune", "quick": args.quick, **cases}))


if __name__ == "__main__":
    main()
