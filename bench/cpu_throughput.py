"""Offline throughput on CPU: Baton's `LLM` vs transformers `generate()` with static batching.

Workload (fixed seed): 64 prompts of 128-512 random token ids (no special tokens), each with
its own ``max_tokens`` drawn from 32-256; greedy; EOS ignored on both sides; float32; the same
SmolLM2-135M-Instruct GGUF loaded by both; both sides use the same number of torch threads.

* Baton: all prompts submitted at once to one `LLM` (continuous batching, chunked prefill).
* transformers: prompts in arrival order in static batches of ``--hf-batch-size`` (left padded);
  each batch generates until its longest request is done (``min_new_tokens`` = ``max_new_tokens``
  = the batch's largest ``max_tokens``, EOS off).

Only requested tokens count on both sides (sum of the per-request ``max_tokens``); tokens a
static batch generates past a request's own limit are work, but not throughput. Model loading and
a short warm-up are not timed. Run: ``python -m bench.cpu_throughput --json`` (the recorded
figure; several minutes on 2 cores: progress goes to stderr). ``--quick`` runs the same path in
seconds on a tiny random Llama (written as a Hugging Face folder, loaded by both sides): a smoke
run, not a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODEL = "builtin:smollm2-135m-instruct"
SMOLLM2_VOCAB = 49152
PROGRESS_EVERY_S = 30.0


def progress(message: str) -> None:
    print(f"[cpu_throughput {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@contextmanager
def heartbeat(what: str, every_s: float = PROGRESS_EVERY_S) -> Iterator[None]:
    """Say every ``every_s`` that ``what`` still runs (elapsed wall and process CPU time)."""
    stop = threading.Event()
    start, cpu_start = time.perf_counter(), time.process_time()

    def beat() -> None:
        while not stop.wait(every_s):
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            progress(f"{what}: {wall:.0f} s so far ({cpu:.0f} s CPU)")

    thread = threading.Thread(target=beat, name="progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def requested_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(
    num_prompts: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = np.random.default_rng(seed)
    # ids below 20 hold SmolLM2's special tokens; random ids above them are ordinary text pieces
    prompts = [
        rng.integers(20, vocab, size=int(rng.integers(prompt_range[0], prompt_range[1] + 1))).tolist()
        for _ in range(num_prompts)
    ]
    max_tokens = [int(rng.integers(output_range[0], output_range[1] + 1)) for _ in range(num_prompts)]
    return Workload(prompts, max_tokens)


def run_baton(work: Workload, model: str, max_num_seqs: int, max_num_batched_tokens: int) -> dict[str, Any]:
    from baton_engine.core.sampling_params import SamplingParams
    from baton_engine.entrypoints.llm import LLM

    longest = max(len(p) + m for p, m in zip(work.prompts, work.max_tokens, strict=True))
    blocks = sum(-(-(len(p) + m) // 16) for p, m in zip(work.prompts, work.max_tokens, strict=True)) + 64
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=max(longest, 1024),
        num_kv_blocks=blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,  # random prompts share nothing; keep the comparison plain
    )
    llm.generate([work.prompts[0][:64]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in work.max_tokens]
    progress(f"Baton: {len(work.prompts)} prompts at once, {work.requested_tokens} tokens requested")
    start, cpu_start = time.perf_counter(), time.process_time()
    with heartbeat("Baton"):
        outputs = llm.generate(work.prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    if produced != work.max_tokens:
        raise RuntimeError("Baton produced a different number of tokens than requested")
    progress(f"Baton: done in {elapsed:.1f} s ({work.requested_tokens / elapsed:.1f} tok/s)")
    return {"seconds": elapsed, "cpu_seconds": cpu, "tokens_per_s": work.requested_tokens / elapsed}


def run_hf(work: Workload, model_ref: str, batch_size: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from baton_engine.model.loader.reference import resolve_model

    if model_ref == MODEL:
        resolved = resolve_model(MODEL)
        model = AutoModelForCausalLM.from_pretrained(
            str(resolved.path.parent), gguf_file=resolved.path.name, dtype=torch.float32
        ).eval()
    else:  # a Hugging Face folder
        model = AutoModelForCausalLM.from_pretrained(model_ref, dtype=torch.float32).eval()
    pad = 0

    def generate(batch: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out: torch.Tensor = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=pad,
            )
        return out

    generate([work.prompts[0][:64]], 4)
    batches = -(-len(work.prompts) // batch_size)
    progress(f"transformers: {len(work.prompts)} prompts in {batches} static batches of {batch_size}")
    start, cpu_start = time.perf_counter(), time.process_time()
    with heartbeat("transformers"):
        for first in range(0, len(work.prompts), batch_size):
            batch = work.prompts[first : first + batch_size]
            new_tokens = max(work.max_tokens[first : first + batch_size])
            out = generate(batch, new_tokens)
            if out.shape[1] != max(len(p) for p in batch) + new_tokens:
                raise RuntimeError("transformers stopped early")
            progress(
                f"transformers: batch {first // batch_size + 1}/{batches} done "
                f"({time.perf_counter() - start:.0f} s)"
            )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {"seconds": elapsed, "cpu_seconds": cpu, "tokens_per_s": work.requested_tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny random Llama, 6 prompts of 16-48 tokens, 4-12 output tokens each: a smoke run",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, both sides")
    parser.add_argument("--seed", type=int, default=0)
    # 32 was the fastest of 16, 32 and 64 for transformers on this workload (bench/RESULTS.md,
    # 2026-11-30): 16 re-reads the weights for few rows, 64 pads all prompts to the longest.
    parser.add_argument("--hf-batch-size", type=int, default=32, help="static batch size for transformers")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="Baton's running-batch limit")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=1024, help="Baton's per-step token budget"
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-cpu-throughput-") as tmp:
        if args.quick:
            from baton_support.tiny_models import TinyModel

            tiny = TinyModel(dtype="float32")
            model = str(Path(tmp) / "tiny-llama")
            tiny.save(Path(model))
            # ids below 20 stand for special tokens, as in SmolLM2's vocabulary
            work = make_workload(6, (16, 48), (4, 12), tiny.vocab_size, args.seed)
            args.hf_batch_size = min(args.hf_batch_size, 4)
        else:
            model = MODEL
            work = make_workload(64, (128, 512), (32, 256), SMOLLM2_VOCAB, args.seed)
        baton = run_baton(work, model, args.max_num_seqs, args.max_num_batched_tokens)
        hf = run_hf(work, model, args.hf_batch_size)
    result = {
        "bench": "cpu_throughput",
        "quick": args.quick,
        "model": "tiny random Llama" if args.quick else MODEL,
        "num_prompts": len(work.prompts),
        "prompt_tokens": sum(len(p) for p in work.prompts),
        "requested_tokens": work.requested_tokens,
        "threads": args.threads,
        "hf_batch_size": args.hf_batch_size,
        "baton_seconds": round(baton["seconds"], 2),
        "hf_seconds": round(hf["seconds"], 2),
        "baton_tokens_per_s": round(baton["tokens_per_s"], 2),
        "hf_tokens_per_s": round(hf["tokens_per_s"], 2),
        "ratio": round(baton["tokens_per_s"] / hf["tokens_per_s"], 3),
        # process CPU time (all threads): on a shared machine wall clock also counts the neighbours
        "baton_cpu_seconds": round(baton["cpu_seconds"], 2),
        "hf_cpu_seconds": round(hf["cpu_seconds"], 2),
        "ratio_cpu_time": round(hf["cpu_seconds"] / baton["cpu_seconds"], 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if not args.json:
        for key, value in result.items():
            print(f"{key:>20}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
