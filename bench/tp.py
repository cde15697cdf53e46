"""Tensor parallelism: engine step time at TP=N against TP=1 in the same run, and each rank's memory.

Workload (fixed seed): `--num-prompts` prompts of `--prompt-len` random token ids, greedy,
`--max-tokens` each with EOS ignored, all submitted at once to one offline `LLM`. The model is a
random Llama written as a Hugging Face folder (4 attention heads over 2 KV heads; `--hidden`
wide, `--layers` deep, so every size up to 4 splits it). For each size the engine is loaded and
warmed up (not timed), then the workload is timed: ``step_ms`` = wall time / engine steps.
Every size must produce the TP=1 tokens (``tokens_identical``).

The reference is TP=1 in the same run. The limit is ``ideal_speedup`` = min(N, usable cores):
on CPU the ranks are processes sharing the host's cores, so a 2-core machine cannot beat 2x,
and each all-reduce (two per layer) costs a gloo round trip. ``rank_rss_mib`` is each rank's
resident memory once loaded (``rank_private_mib`` its anonymous part: the weights it copied in,
its KV cache; the rest is the Python/torch runtime every process carries): each rank holds its
shard and the KV cache of its own heads.

Run: ``python -m bench.tp --json`` (CPU; figures in bench/RESULTS.md). ``--quick`` runs a tiny
model for seconds (a smoke run, not a figure). ``--device cuda --sizes 1,2`` is the GPU path (NCCL
or RCCL); sizes above the visible GPU count are skipped and reported as such.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP (it reads this once): spinning worker threads collapse beside any
# other busy process on a small machine (a TP=1 run measured 1254 ms per step spinning, 153
# passive), and the engine core waits passively too. Rank processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def progress(message: str) -> None:
    print(f"[tp {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_model(directory: Path, hidden: int, layers: int, vocab: int) -> None:
    from baton_support.tiny_models import TinyModel

    TinyModel(hidden_size=hidden, num_layers=layers, vocab_size=vocab, dtype="float32", seed=3).save(
        directory
    )


def run_size(model: Path, size: int, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from baton_engine import LLM, SamplingParams
    from baton_engine.worker.tp_executor import TensorParallelExecutor

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(
        str(model),
        device=args.device,
        dtype="float32" if args.device == "cpu" else "bfloat16",
        tensor_parallel_size=size,
        max_model_len=args.prompt_len + args.max_tokens + 8,
        tensor_parallel_timeout_seconds=300.0,
    )
    try:
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
        steps_before = llm.core.stats().num_steps
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - started
        steps = llm.core.stats().num_steps - steps_before
        runner = llm.core.runner
        if isinstance(runner, TensorParallelExecutor):
            memory = {str(rank): m for rank, m in runner.memory.items()}
        else:
            from baton_engine.worker.memory import process_memory

            memory = {"0": process_memory(torch.device(args.device))}
        tokens = [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.close()
    generated = sum(len(t) for t in tokens)
    return {
        "wall_s": round(wall, 3),
        "steps": steps,
        "step_ms": round(1000 * wall / max(steps, 1), 3),
        "tokens_per_s": round(generated / wall, 1),
        "rank_rss_mib": {rank: round(m.get("rss_bytes", 0) / 2**20, 1) for rank, m in memory.items()},
        "rank_private_mib": {rank: round(m.get("private_bytes", 0) / 2**20, 1) for rank, m in memory.items()},
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--quick", action="store_true", help="a tiny model for seconds (smoke run)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (NCCL/RCCL ranks, one GPU each)")
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated (1 first)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vocab = 64, 2, 256
        args.num_prompts, args.prompt_len, args.max_tokens = 2, 12, 6
    threads = torch.get_num_threads()  # TP=1's (a TP rank 0 in this process sets its own share)
    sizes = [int(s) for s in args.sizes.split(",")]
    if sizes[0] != 1:
        parser.error("--sizes must start with 1 (the reference)")
    visible = torch.cuda.device_count() if args.device.startswith("cuda") else None
    skipped = [s for s in sizes if visible is not None and s > visible]
    sizes = [s for s in sizes if s not in skipped]
    rng = np.random.default_rng(0)
    prompts = [
        [int(t) for t in rng.integers(0, args.vocab, args.prompt_len)] for _ in range(args.num_prompts)
    ]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        model = Path(tmp) / "model"
        build_model(model, args.hidden, args.layers, args.vocab)
        for size in sizes:
            progress(f"TP={size}: loading and running {args.num_prompts} prompts")
            results[str(size)] = run_size(model, size, args, prompts)
            progress(f"TP={size}: {results[str(size)]['step_ms']} ms per step")
    reference = results["1"]
    identical = all(r["tokens"] == reference["tokens"] for r in results.values())
    cores = len(os.sched_getaffinity(0)) if args.device == "cpu" else None
    largest = str(max(sizes))
    speedup = round(reference["step_ms"] / results[largest]["step_ms"], 3)
    ideal = min(int(largest), cores) if cores is not None else int(largest)
    for r in results.values():
        del r["tokens"]
    report = {
        "bench": "tp",
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d"),
        "device": args.device,
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "vocab": args.vocab,
            "heads": 4,
            "kv_heads": 2,
        },
        "workload": {
            "prompts": args.num_prompts,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
        },
        "sizes": results,
        "skipped_sizes": skipped,
        "speedup": speedup,
        "speedup_of": f"TP={largest} vs TP=1",
        "ideal_speedup": ideal,
        "tokens_identical": identical,
        "cores": cores,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "torch_threads_tp1": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "machine": platform.processor() or platform.machine(),
    }
    if not identical:
        progress("tokens differ between sizes")
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
