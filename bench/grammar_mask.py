"""Per-token cost of grammar-constrained decoding at batch 64: computing the token masks (CPU)
and applying them to the logits, llguidance against xgrammar in the same run.

Each of the 64 rows generates a different schema-valid JSON document (SmolLM2's 49152-token
vocabulary, the JSON schema of an OpenAI ``response_format``), token by token: per step every
row's mask is computed for its current state, then the row consumes its next token. Reported
per step (all 64 rows) and per row-token:

- ``mask_us_per_step``: llguidance (sequential, and parallel with its executor) and xgrammar
  (its batch matcher), computing the 64 bitmasks into one pinned int32 buffer;
- ``consume_us_per_step``: advancing the 64 matchers by their token;
- ``apply_us_per_step``: the bitmask applied to [64, vocab] float32 logits with torch ops
  (``bitmask_to_bool`` + ``masked_fill_``, what the sampler runs, on the device, without a host
  sync), beside the two references that bound it: the sampler's own greedy pick (argmax) over
  the same logits, and a plain copy of the bitmask (the physical floor: 64 x 6 KiB).

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
    from baton_engine.structured.bitmask import apply_bitmask

    words = (vocab_size + 31) // 32
    logits = torch.randn(BATCH, vocab_size)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (BATCH, words), dtype=torch.int32)
    work = logits.clone()
    copy_target = torch.empty_like(bitmask)

    def apply() -> None:
        work.copy_(logits)
        apply_bitmask(work, bitmask)

    def copy_only() -> None:
        work.copy_(logits)

    def argmax() -> None:
        logits.argmax(dim=-1)

    for fn in (apply, copy_only, argmax):
        fn()  # warm-up
    apply_times = [_timed(apply) for _ in range(repeats)]
    logits_copy = [_timed(copy_only) for _ in range(repeats)]
    mask_copy = [_timed(lambda: copy_target.copy_(bitmask)) for _ in range(repeats)]
    argmax_times = [_timed(argmax) for _ in range(repeats)]
    apply_net = [max(a - c, 0.0) for a, c in zip(apply_times, logits_copy, strict=True)]
    return {
        "apply_us_per_step": _us(apply_net),
        "reference_argmax_us_per_step": _us(argmax_times),
        "floor_bitmask_copy_us_per_step": _us(mask_copy),
        "device": "cpu",
    }


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
