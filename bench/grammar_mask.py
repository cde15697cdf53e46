"""Per-token cost of grammar-constrained decoding at batch 64: computing the token masks (CPU)
and applying them to the logits, llguidance against xgrammar in the same run.

Each of the 64 rows generates a different schema-valid JSON document (SmolLM2's 49152-token
vocabulary, the JSON schema of an OpenAI ``response_format``), token by token: per step every
row's mask is computed for its current state, then the row consumes its next token. Reported
per step (all 64 rows) and per row-token:

- ``mask_us_per_step``: llguidance (sequential, and parallel with its executor) and xgrammar
  (its batch matcher), computing the 64 bitmasks into one pinned int32 buffer;
- ``consume_us_per_step``: advancing the 64 matchers by their token;
- ``apply_us_per_step``: the bitmask applied to [64, vocab] float32 logits, as the runners do it
  (`baton_engine.worker.token_bitmask`): on the CPU runner numpy unpacks the bits and torch
  does one ``masked_fill_`` (``host``); a device runs tensor ops only, no host sync (``tensor_ops``,
  timed here on the CPU for comparison; on a GPU both are element-wise passes over 3 M logits),
  beside the two references that bound it: the sampler's own greedy pick (argmax) over the same
  logits, and a plain copy of the bitmask (the physical floor: 64 x 6 KiB);
- ``engine_step``: the same 64 documents through the engine's own scheduler
  (`StructuredOutputManager` in ``schedule()`` and ``postprocess()``) and the CPU runner's
  mask application, per decode step, against the same 64 rows without a grammar (a stand-in
  model output, so no forward is timed): ``overhead_us_per_row_token`` is what structured
  output adds to each generated token at batch 64.

Run: ``python -m bench.grammar_mask --json`` (one JSON object on the last line).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

BATCH = 64
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Ken Thompson"]
CITIES = ["Paris", "Zürich", "New York", "São Paulo", "Tokyo", "Lagos"]


def documents(count: int, seed: int) -> list[str]:
    """`count` different documents valid under `SCHEMA`, in the compact form both compilers allow."""
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        name = rng.choice(NAMES)
        doc = {
            "name": f"{name} {i}",
            "age": rng.randint(18, 99),
            "email": f"{name.split()[0].lower()}{i}@example.org",
            "tags": [rng.choice(["admin", "dev", "ops", "research"]) for _ in range(rng.randint(0, 4))],
            "address": {"city": rng.choice(CITIES), "zip": f"{rng.randint(10000, 99999)}"},
            "active": rng.random() < 0.5,
        }
        docs.append(json.dumps(doc, ensure_ascii=False, separators=(",", ":")))
    return docs


def _timed(fn: Callable[..., object], *args: object) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def _check_allowed(name: str, bitmask: torch.Tensor, row_tokens: list[tuple[int, int]], step: int) -> None:
    """Each row's mask allows the row's own next token (a check of the setup, not timed)."""
    for row, token in row_tokens:
        if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
            raise RuntimeError(f"{name} refused token {token} of row {row} at step {step}")


def bench_llguidance(backend_json: str, eos: int, rows: list[list[int]]) -> dict[str, Any]:
    import llguidance
    import llguidance.torch as llt

    tokenizer = llguidance.LLTokenizer(backend_json, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    )
    started = time.perf_counter()
    matchers = [llguidance.LLMatcher(tokenizer, grammar, log_level=0) for _ in rows]
    compile_s = time.perf_counter() - started
    errors = [m.get_error() for m in matchers if m.is_error()]
    if errors:
        raise RuntimeError(f"llguidance: {errors[0]}")
    bitmask = llt.allocate_token_bitmask(len(rows), tokenizer.vocab_size)
    executor = llguidance.LLExecutor()
    steps = max(len(r) for r in rows)
    seq_times, par_times, consume_times = [], [], []
    for step in range(steps):
        live = [(m, i) for i, m in enumerate(matchers) if step < len(rows[i])]
        tokens = [(m, rows[i][step]) for m, i in live]
        seq_times.append(
            _timed(lambda pairs: [llt.fill_next_token_bitmask(m, bitmask, i) for m, i in pairs], live)
        )
        par_times.append(_timed(llt.fill_next_token_bitmask_par, executor, live, bitmask))
        _check_allowed("llguidance", bitmask, [(i, rows[i][step]) for _, i in live], step)
        consume_times.append(_timed(lambda pairs: [m.consume_token(t) for m, t in pairs], tokens))
    accepting = sum(m.is_accepting() for m in matchers)
    return {
        "compile_ms_64_matchers": round(compile_s * 1e3, 2),
        "mask_us_per_step_sequential": _us(seq_times),
        "mask_us_per_step_parallel": _us(par_times),
        "consume_us_per_step": _us(consume_times),
        "threads": os.cpu_count(),
        "rows_accepting_at_end": accepting,
    }


def bench_xgrammar(vocab: list[bytes], eos: int, vocab_size: int, rows: list[list[int]]) -> dict[str, Any]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    matchers = [xgr.GrammarMatcher(compiled) for _ in rows]
    compile_s = time.perf_counter() - started
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    batch = xgr.BatchGrammarMatcher()
    steps = max(len(r) for r in rows)
    seq_times, par_times, consume_times = [], [], []
    for step in range(steps):
        live = [(m, i) for i, m in enumerate(matchers) if step < len(rows[i])]
        tokens = [(m, rows[i][step]) for m, i in live]
        seq_times.append(
            _timed(lambda pairs: [m.fill_next_token_bitmask(bitmask, i) for m, i in pairs], live)
        )
        live_matchers, indices = [m for m, _ in live], [i for _, i in live]
        par_times.append(_timed(batch.batch_fill_next_token_bitmask, live_matchers, bitmask, indices))
        _check_allowed("xgrammar", bitmask, [(i, rows[i][step]) for _, i in live], step)
        consume_times.append(_timed(lambda pairs: [m.accept_token(t) for m, t in pairs], tokens))
    return {
        "compile_ms_64_matchers": round(compile_s * 1e3, 2),
        "mask_us_per_step_sequential": _us(seq_times),
        "mask_us_per_step_parallel": _us(par_times),
        "consume_us_per_step": _us(consume_times),
    }


def bench_apply(vocab_size: int, repeats: int) -> dict[str, Any]:
    from baton_engine.worker.token_bitmask import apply_token_bitmask, apply_token_bitmask_host

    words = (vocab_size + 31) // 32
    logits = torch.randn(BATCH, vocab_size)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (BATCH, words), dtype=torch.int32)
    bitmask_np = bitmask.numpy()
    work = logits.clone()
    copy_target = torch.empty_like(bitmask)

    def host() -> None:
        work.copy_(logits)
        apply_token_bitmask_host(work, bitmask_np)

    def tensor_ops() -> None:
        work.copy_(logits)
        apply_token_bitmask(work, bitmask)

    def copy_only() -> None:
        work.copy_(logits)

    def argmax() -> None:
        logits.argmax(dim=-1)

    for fn in (host, tensor_ops, copy_only, argmax):
        fn()  # warm-up
    # interleaved, so that a burst of load on the shared machine hits every variant alike
    times: dict[str, list[float]] = {"host": [], "tensor_ops": [], "copy": [], "argmax": [], "mask_copy": []}
    for _ in range(repeats):
        times["host"].append(_timed(host))
        times["tensor_ops"].append(_timed(tensor_ops))
        times["copy"].append(_timed(copy_only))
        times["argmax"].append(_timed(argmax))
        times["mask_copy"].append(_timed(lambda: copy_target.copy_(bitmask)))

    def net(name: str) -> list[float]:
        return [max(a - c, 0.0) for a, c in zip(times[name], times["copy"], strict=True)]

    return {
        "apply_us_per_step": {"host": _us(net("host")), "tensor_ops": _us(net("tensor_ops"))},
        "reference_argmax_us_per_step": _us(times["argmax"]),
        "floor_bitmask_copy_us_per_step": _us(times["mask_copy"]),
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
    }


def bench_engine_step(tokenizer: Any, batch: int, seed: int) -> dict[str, Any]:
    """The scheduler's structured-output work per decode step (masks in ``schedule()``, accepting
    in ``postprocess()``) plus the CPU runner's mask application, with and without grammars."""
    import numpy as np

    from baton_engine.core.request import Request
    from baton_engine.core.sampling_params import SamplingParams
    from baton_engine.core.scheduler import Scheduler
    from baton_engine.core.scheduler_output import ModelRunnerOutput
    from baton_engine.structured.grammar import response_format_grammar
    from baton_engine.structured.manager import StructuredOutputManager
    from baton_engine.worker.token_bitmask import apply_token_bitmask_host

    vocab_size = tokenizer.vocab_size
    eos = tokenizer.eos_token_ids[0]
    grammar = response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "doc", "schema": SCHEMA}}
    )
    # The engine's canonical spacing (", " and ": "), which its JSON grammars enforce.
    docs = [json.dumps(json.loads(doc), ensure_ascii=False) for doc in documents(batch, seed)]
    rows = [tokenizer.encode(doc, add_special_tokens=False) for doc in docs]
    manager = StructuredOutputManager(tokenizer.backend.to_str, vocab_size, (eos,))
    manager.add(-1, grammar)  # build the token trie before anything is timed
    manager.remove(-1)
    logits = torch.randn(batch, vocab_size)
    result: dict[str, Any] = {}
    for mode in ("free", "grammar"):
        scheduler = Scheduler(
            num_blocks=batch * 8,
            block_size=16,
            max_num_seqs=batch,
            max_num_batched_tokens=4096,
            max_model_len=256,
            eos_token_id=eos,
            structured_output=manager,
        )
        seqs = []
        for i, tokens in enumerate(rows):
            params = SamplingParams(
                temperature=0.0, max_tokens=len(tokens), grammar=grammar if mode == "grammar" else None
            )
            seqs.append(Request(i, tokenizer.encode(f"Person {i} as JSON:"), params))
            scheduler.add(seqs[-1])
        schedule_s: list[float] = []
        apply_s: list[float] = []
        postprocess_s: list[float] = []
        while scheduler.has_unfinished():
            started = time.perf_counter()
            out = scheduler.schedule()
            scheduled = time.perf_counter()
            if not out.num_rows:
                scheduler.take_finished()
                continue
            work = logits[: len(out.logits_indices)]
            if out.grammar_bitmask is not None:
                apply_token_bitmask_host(work, out.grammar_bitmask, out.grammar_rows)
            applied = time.perf_counter()
            tokens = [
                rows[scheduler.batch.requests[r].req_id][scheduler.batch.requests[r].num_output_tokens]
                for r in out.sample_rows.tolist()
            ]
            result_tokens = ModelRunnerOutput(
                step_id=out.step_id,
                sampled_token_ids=[[t] for t in tokens],
                sampled_token_array=np.asarray(tokens, dtype=np.int64),
            )
            before_post = time.perf_counter()
            scheduler.postprocess(out, result_tokens)
            done = time.perf_counter()
            if out.num_decode_rows == batch:  # full decode steps only (not the prefill)
                schedule_s.append(scheduled - started)
                apply_s.append(applied - scheduled)
                postprocess_s.append(done - before_post)
        reasons = {seq.finish_reason.value for seq in seqs if seq.finish_reason is not None}
        if mode == "grammar" and reasons != {"stop"}:
            raise RuntimeError(f"constrained rows finished with {reasons}, expected only 'stop'")
        total = [a + b + c for a, b, c in zip(schedule_s, apply_s, postprocess_s, strict=True)]
        result[mode] = {
            "schedule_us_per_step": _us(schedule_s),
            "apply_us_per_step": _us(apply_s),
            "postprocess_us_per_step": _us(postprocess_s),
            "total_us_per_step": _us(total),
            "steps": len(total),
        }
    overhead = (
        result["grammar"]["total_us_per_step"]["median"] - result["free"]["total_us_per_step"]["median"]
    )
    result["overhead_us_per_step"] = round(overhead, 1)
    result["overhead_us_per_row_token"] = round(overhead / batch, 2)
    return result


def _us(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median": round(statistics.median(ordered) * 1e6, 1),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e6, 1),
        "mean": round(statistics.fmean(ordered) * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="Print only the JSON result.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 rows instead of 64 (a smoke run).")
    args = parser.parse_args(argv)
    from baton_engine.model.loader.tokenizer_loading import load_tokenizer
    from baton_engine.server.openai_format import TokenText

    tokenizer = load_tokenizer("builtin:smollm2-135m-instruct")
    eos = tokenizer.eos_token_ids[0]
    vocab_size = tokenizer.vocab_size
    token_text = TokenText(tokenizer)
    vocab = [bytes(token_text.token_bytes(i)) for i in range(vocab_size)]
    batch = 8 if args.quick else BATCH
    docs = documents(batch, args.seed)
    rows = [tokenizer.encode(doc, add_special_tokens=False) + [eos] for doc in docs]
    result: dict[str, Any] = {
        "bench": "grammar_mask",
        "quick": args.quick,
        "batch": batch,
        "vocab_size": vocab_size,
        "tokens_per_row": {"min": min(map(len, rows)), "max": max(map(len, rows))},
        "llguidance": bench_llguidance(tokenizer.backend.to_str(), eos, rows),
        "xgrammar": bench_xgrammar(vocab, eos, vocab_size, rows),
        "apply": bench_apply(vocab_size, repeats=50 if args.quick else 200),
        "engine_step": bench_engine_step(tokenizer, batch, args.seed),
        "versions": {
            "llguidance": importlib.metadata.version("llguidance"),
            "xgrammar": importlib.metadata.version("xgrammar"),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    for name in ("llguidance", "xgrammar"):
        best = min(
            result[name]["mask_us_per_step_sequential"]["median"],
            result[name]["mask_us_per_step_parallel"]["median"],
        )
        result[name]["mask_us_per_row_token"] = round(best / batch, 2)
    if not args.json:
        for name in ("llguidance", "xgrammar"):
            r = result[name]
            print(
                f"{name}: mask {r['mask_us_per_step_sequential']['median']} us/step sequential, "
                f"{r['mask_us_per_step_parallel']['median']} us/step parallel, "
                f"consume {r['consume_us_per_step']['median']} us/step"
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
