"""GPU benchmark: copy bandwidth, weight sweep, batch-1 decode (8B), throughput vs transformers (1B).

``python -m bench.gpu --json`` on one GPU, random-weight models built from configs (no downloads),
bfloat16. Imports torch, triton, numpy, transformers (the reference) and the engine only. Each
section records its error instead of aborting the run; partial results go to ``$OUT`` as it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler import Scheduler
from baton_engine.model.config import ModelConfig
from baton_engine.model.linear import QuantizationConfig
from baton_engine.model.llama import Weights, build_model
from baton_engine.model.loader.model_loading import LoadedModel
from baton_engine.model.loader.reference import ResolvedModel
from baton_engine.worker.gpu.model_runner import GpuModelRunner
from bench.shapes import LLAMA_32_1B

LLAMA_31_8B = ModelConfig(
    family="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    name="llama-3.1-8b-shape",
)
TINY = ModelConfig(
    family="llama",
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    name="tiny-random",
)


def random_weights(
    config: ModelConfig, dtype: torch.dtype, device: str, seed: int
) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def norm_weight() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(config.hidden_size, generator=gen, device=device)).to(dtype)

    h, d = config.hidden_size, config.head_dim
    weights = {"model.embed_tokens.weight": normal(config.vocab_size, h), "model.norm.weight": norm_weight()}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm_weight()
        weights[p + "post_attention_layernorm.weight"] = norm_weight()
        weights[p + "self_attn.q_proj.weight"] = normal(config.num_heads * d, h)
        weights[p + "self_attn.k_proj.weight"] = normal(config.num_kv_heads * d, h)
        weights[p + "self_attn.v_proj.weight"] = normal(config.num_kv_heads * d, h)
        weights[p + "self_attn.o_proj.weight"] = normal(h, config.num_heads * d)
        weights[p + "mlp.gate_proj.weight"] = normal(config.intermediate_size, h)
        weights[p + "mlp.up_proj.weight"] = normal(config.intermediate_size, h)
        weights[p + "mlp.down_proj.weight"] = normal(h, config.intermediate_size)
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = normal(config.vocab_size, h)
    return weights


def make_core(
    config: ModelConfig,
    weights: Weights,
    dtype: torch.dtype,
    graph_sizes: tuple[int, ...],
    quantization: QuantizationConfig | None = None,
    **settings: Any,
) -> tuple[EngineCore, GpuModelRunner]:
    model = build_model(config, weights, dtype, "cuda", quantization=quantization)
    loaded = LoadedModel(
        model, config, None, config.name, ResolvedModel("safetensors", Path("/nonexistent"), config.name)
    )
    dtype_name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    engine_config = EngineConfig(model=config.name, device="cuda", dtype=dtype_name, **settings)
    runner = GpuModelRunner(engine_config, loaded, graph_batch_sizes=graph_sizes)
    scheduler = Scheduler.from_config(engine_config, num_blocks=runner.num_blocks, eos_token_id=None)
    return EngineCore(scheduler, runner), runner


def run_requests(core: EngineCore, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        rid = f"r{i}"
        outputs[rid] = []
        core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while core.has_unfinished():
        for out in core.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return outputs


def cuda_time_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


# -- sections -------------------------------------------------------------------------------
def copy_bandwidth() -> dict[str, Any]:
    src = torch.randn(1 << 30, device="cuda", dtype=torch.float32)  # 4 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = statistics.median(cuda_time_ms(lambda: dst.copy_(src), 10))
    nbytes = src.numel() * src.element_size()
    return {"copy_bandwidth_gbps": round(2 * nbytes / (ms * 1e-3) / 1e9, 1), "copy_ms_4gib": round(ms, 3)}


def parity() -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    weights = random_weights(TINY, torch.float32, "cuda", seed=7)
    gen = np.random.default_rng(3)
    prompts = [gen.integers(0, TINY.vocab_size, size=n).tolist() for n in (5, 17, 40, 100)]
    new_tokens = 24
    core, _ = make_core(
        TINY, weights, torch.float32, (1, 2, 4), max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64
    )
    baton = run_requests(core, prompts, [new_tokens] * len(prompts))
    hf = hf_model(TINY, weights, torch.float32, LlamaConfig, LlamaForCausalLM)
    mismatches = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
        ref = out[0, len(prompt) :].tolist()
        if ref != baton[f"r{i}"]:
            mismatches.append({"prompt": i, "hf": ref, "baton": baton[f"r{i}"]})
    return {"parity_ok": not mismatches, "parity_mismatches": mismatches[:2]}


def hf_model(
    config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, cfg_cls: Any, model_cls: Any
) -> Any:
    cfg = cfg_cls(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        attn_implementation="sdpa",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.device("cuda"):
        model = model_cls(cfg).to(dtype)
    missing = model.load_state_dict(weights, strict=False, assign=True).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing[:3]
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval().requires_grad_(False)


def eight_b(result: dict[str, Any]) -> None:
    weights = random_weights(LLAMA_31_8B, torch.bfloat16, "cuda", seed=1)
    core, runner = make_core(
        LLAMA_31_8B,
        weights,
        torch.bfloat16,
        (1,),
        max_num_seqs=8,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        gpu_memory_utilization=0.5,
    )
    del weights
    model = runner.model
    # The sweep: every linear layer's weight as a batch-1 matrix-vector product, then the lm_head.
    # The model stores q/k/v and gate/up fused; the sweep multiplies each part on its own.
    cfg = LLAMA_31_8B
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mats = []
    for layer in model.model.layers:
        qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
        mats += list(qkv.split([q_rows, kv_rows, kv_rows])) + [layer.self_attn.o_proj.weight]
        mats += list(gate_up.chunk(2)) + [layer.mlp.down_proj.weight]
    mats.append(runner.fused.lm_head.weight)
    xs = {w.shape[1]: torch.randn(1, w.shape[1], device="cuda", dtype=torch.bfloat16) for w in mats}
    outs = [torch.empty(1, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in mats]

    def sweep() -> None:
        for w, o in zip(mats, outs, strict=True):
            torch.matmul(xs[w.shape[1]], w.t(), out=o)

    sweep()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sweep()
    for _ in range(3):
        graph.replay()
    sweep_ms = statistics.median(cuda_time_ms(graph.replay, 20))
    weight_bytes = sum(w.numel() * w.element_size() for w in mats)
    result["weight_sweep_ms_8b"] = round(sweep_ms, 3)
    result["weight_bytes_8b"] = weight_bytes
    result["weight_sweep_gbps_8b"] = round(weight_bytes / (sweep_ms * 1e-3) / 1e9, 1)
    # Baton: one request, 512-token prompt, then timed engine steps (each ends with the token read).
    prompt = np.random.default_rng(0).integers(0, LLAMA_31_8B.vocab_size, size=512).tolist()

    def b1_step_ms(request_id: str) -> float:
        core.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
        core.step()  # prefill + first token
        times = []
        while core.has_unfinished():
            t0 = time.perf_counter()
            core.step()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[8:])

    runner.decode_ahead = False
    result["b1_decode_ms_8b_no_ahead"] = round(b1_step_ms("b1-plain"), 3)
    runner.decode_ahead = True
    hits = runner.ahead_hits
    step_ms = b1_step_ms("b1")
    result["ahead_hits_8b_of_79"] = runner.ahead_hits - hits
    graph_ms = statistics.median(cuda_time_ms(runner._graphs[1].graph.replay, 20))
    result["b1_decode_ms_8b"] = round(step_ms, 3)
    result["b1_decode_graph_ms_8b"] = round(graph_ms, 3)
    result["engine_vs_sweep"] = round(sweep_ms / step_ms, 3)
    result["graph_vs_sweep"] = round(sweep_ms / graph_ms, 3)
    result["kv_blocks_8b"] = runner.num_blocks


def one_b(result: dict[str, Any], quick: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    n_req, n_in, n_out = (32, 128, 32) if quick else (256, 512, 256)
    weights = random_weights(LLAMA_32_1B, torch.bfloat16, "cuda", seed=2)
    graph_sizes = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)
    settings: dict[str, Any] = dict(
        max_num_seqs=256,
        max_model_len=1024,
        max_num_batched_tokens=16384,
        gpu_memory_utilization=0.5,
        enable_prefix_caching=False,
    )
    core, runner = make_core(LLAMA_32_1B, weights, torch.bfloat16, graph_sizes, **settings)
    result["kv_blocks_1b"] = runner.num_blocks
    rng = np.random.default_rng(1)
    # Warm-up (kernel compilation) and the sync check: every device step under sync-debug "error".
    warm = [
        rng.integers(0, LLAMA_32_1B.vocab_size, size=int(n)).tolist() for n in rng.integers(20, 300, size=24)
    ]
    runner.sync_debug = True
    try:
        run_requests(core, warm, [40] * len(warm))
        result["sync_debug_ok"] = True
    except Exception as exc:  # reported, not hidden; the step loop is then unusable
        result["sync_debug_ok"] = False
        result["sync_debug_error"] = repr(exc)[:400]
        del core, runner
        torch.cuda.empty_cache()
        core, runner = make_core(LLAMA_32_1B, weights, torch.bfloat16, graph_sizes, **settings)
    runner.sync_debug = False
    prompts = [rng.integers(0, LLAMA_32_1B.vocab_size, size=n_in).tolist() for _ in range(n_req)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    baton = run_requests(core, prompts, [n_out] * n_req)
    elapsed = time.perf_counter() - t0
    produced = sum(len(v) for v in baton.values())
    assert produced == n_req * n_out, produced
    result["baton_tokens_per_s_1b"] = round(produced / elapsed, 1)
    result["baton_seconds_1b"] = round(elapsed, 3)
    lengths = rng.integers(64, 513, size=n_req).tolist()
    t0 = time.perf_counter()
    var = run_requests(core, prompts, lengths)
    elapsed_var = time.perf_counter() - t0
    result["baton_tokens_per_s_1b_var"] = round(sum(len(v) for v in var.values()) / elapsed_var, 1)
    result["ahead_hits_1b"] = runner.ahead_hits
    result["ahead_misses_1b"] = runner.ahead_misses
    runner.decode_ahead = False
    t0 = time.perf_counter()
    run_requests(core, prompts, [n_out] * n_req)
    result["baton_tokens_per_s_1b_no_ahead"] = round(n_req * n_out / (time.perf_counter() - t0), 1)
    runner.decode_ahead = True
    result["baton_steps_1b_total"] = core.stats().num_steps
    # The device time of one captured decode step at batch 256, every row at 640 tokens of context.
    ctx, blocks = 640, 640 // runner.block_size
    runner._g_seq_lens.fill_(ctx)
    runner._g_slots.fill_(-1)
    runner._g_tables[:, :blocks].copy_(
        torch.arange(256 * blocks, device="cuda", dtype=torch.int32).view(256, blocks)
    )
    graph_ms = statistics.median(cuda_time_ms(runner._graphs[256].graph.replay, 20))
    kv_bytes = 256 * ctx * runner.kv_cache[:, :, 0, 0].numel() * runner.kv_cache.element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    result["decode_graph_ms_1b_b256_ctx640"] = round(graph_ms, 3)
    result["decode_graph_gbps_1b_b256_ctx640"] = round((kv_bytes + weight_bytes) / (graph_ms * 1e-3) / 1e9, 1)
    # transformers on the same weights (shared tensors), all requests in one generate() call.
    # `weights` holds the checkpoint-named tensors the engine's fused ones were built from.
    hf = hf_model(LLAMA_32_1B, weights, torch.bfloat16, LlamaConfig, LlamaForCausalLM)
    ids = torch.tensor(prompts, device="cuda")
    hf.generate(ids[:8, :64], attention_mask=torch.ones_like(ids[:8, :64]), max_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False
    )
    torch.cuda.synchronize()
    hf_elapsed = time.perf_counter() - t0
    hf_tokens = (out.shape[1] - n_in) * n_req
    result["hf_tokens_per_s_1b"] = round(hf_tokens / hf_elapsed, 1)
    result["hf_seconds_1b"] = round(hf_elapsed, 3)
    result["throughput_ratio_vs_hf_1b"] = round(
        result["baton_tokens_per_s_1b"] / result["hf_tokens_per_s_1b"], 2
    )
    # Same weights, same greedy path: the first tokens of a few requests should agree (bf16 may drift).
    agree = sum(out[i, n_in : n_in + 8].tolist() == baton[f"r{i}"][:8] for i in range(min(n_req, 16)))
    result["hf_first8_agree_of_16"] = int(agree)
    # bf16 greedy paths drift apart at near-ties: Baton's first token should still be (almost)
    # transformers' best, i.e. its HF logit within bf16 noise of the HF maximum.
    with torch.no_grad():
        last = hf(ids[:16], attention_mask=torch.ones_like(ids[:16])).logits[:, -1].float()
    first = torch.tensor([baton[f"r{i}"][0] for i in range(16)], device="cuda")
    margins = last.max(-1).values - last.gather(-1, first[:, None])[:, 0]
    result["hf_first_token_agree_of_16"] = int((margins == 0).sum())
    result["hf_first_token_max_logit_margin"] = round(float(margins.max()), 4)
    result["hf_logit_std"] = round(float(last.std()), 4)


def kernels(result: dict[str, Any]) -> None:
    """The attention choice, measured: Triton paged kernels vs PyTorch SDPA (1B shape, bf16)."""
    from baton_engine.model.kernels.triton_attention import (
        DecodeWorkspace,
        decode_num_splits,
        paged_decode_attention,
        paged_prefill_attention,
        prefill_tiles,
    )

    heads, kv_heads, dim, bs = 32, 8, 64, 16
    batch, ctx = 256, 640
    blocks = ctx // bs
    cache = torch.randn(2, batch * blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    ws = DecodeWorkspace(batch, heads, dim, decode_num_splits(batch, kv_heads, ctx), torch.device("cuda"))
    slots = (tables.long()[:, :, None] * bs + torch.arange(bs, device="cuda")).view(batch, ctx)

    def torch_decode() -> None:  # the reference backend's way: gather the rows' K/V, then SDPA
        k = cache[0].view(-1, kv_heads, dim)[slots].transpose(1, 2)
        v = cache[1].view(-1, kv_heads, dim)[slots].transpose(1, 2)
        F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)

    def triton_decode() -> None:
        paged_decode_attention(q, cache, tables, lens, dim**-0.5, ws)

    for fn in (torch_decode, triton_decode):
        fn()
    result["attn_decode_torch_ms_b256_ctx640"] = round(statistics.median(cuda_time_ms(torch_decode, 20)), 3)
    result["attn_decode_triton_ms_b256_ctx640"] = round(statistics.median(cuda_time_ms(triton_decode, 20)), 3)
    kv_bytes = batch * ctx * 2 * kv_heads * dim * 2
    result["attn_decode_triton_gbps"] = round(
        kv_bytes / (result["attn_decode_triton_ms_b256_ctx640"] * 1e-3) / 1e9, 1
    )
    # Prefill: 32 fresh prompts of 512 tokens. SDPA gets them as one padded dense batch (its best case).
    n, length = 32, 512
    pblocks = length // bs
    pq = torch.randn(n * length, heads, dim, device="cuda", dtype=torch.bfloat16)
    ptables = torch.arange(n * pblocks, device="cuda", dtype=torch.int32).view(n, pblocks)
    starts = torch.arange(0, (n + 1) * length, length, device="cuda", dtype=torch.int32)
    plens = torch.full((n,), length, device="cuda", dtype=torch.int32)
    rows, offs = prefill_tiles([length] * n)
    tile_rows = torch.tensor(rows, device="cuda", dtype=torch.int32)
    tile_starts = torch.tensor(offs, device="cuda", dtype=torch.int32)
    dense_q = pq.view(n, length, heads, dim).transpose(1, 2)
    dense_k = cache[0, : n * pblocks].reshape(n, length, kv_heads, dim).transpose(1, 2)
    dense_v = cache[1, : n * pblocks].reshape(n, length, kv_heads, dim).transpose(1, 2)

    def torch_prefill() -> None:
        F.scaled_dot_product_attention(dense_q, dense_k, dense_v, is_causal=True, enable_gqa=True)

    def triton_prefill() -> None:
        paged_prefill_attention(pq, cache, ptables, starts, plens, tile_rows, tile_starts, dim**-0.5)

    for fn in (torch_prefill, triton_prefill):
        fn()
    result["attn_prefill_torch_sdpa_ms_32x512"] = round(statistics.median(cuda_time_ms(torch_prefill, 20)), 3)
    result["attn_prefill_triton_ms_32x512"] = round(statistics.median(cuda_time_ms(triton_prefill, 20)), 3)


def agreement(result: dict[str, Any]) -> None:
    """bf16 noise floor: first greedy token of Baton (bf16) and transformers (bf16) against
    transformers in float32 on the same (bf16-representable) 1B weights, 16 prompts of 512."""
    from transformers import LlamaConfig, LlamaForCausalLM

    weights = random_weights(LLAMA_32_1B, torch.bfloat16, "cuda", seed=2)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, LLAMA_32_1B.vocab_size, size=512).tolist() for _ in range(16)]
    core, runner = make_core(
        LLAMA_32_1B,
        weights,
        torch.bfloat16,
        (16,),
        max_num_seqs=16,
        max_model_len=1024,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.3,
    )
    baton = run_requests(core, prompts, [1] * 16)
    state = weights
    del core, runner
    ids = torch.tensor(prompts, device="cuda")
    firsts: dict[str, torch.Tensor] = {
        "baton_bf16": torch.tensor([baton[f"r{i}"][0] for i in range(16)], device="cuda")
    }
    with torch.no_grad():
        hf16 = hf_model(LLAMA_32_1B, state, torch.bfloat16, LlamaConfig, LlamaForCausalLM)
        firsts["hf_bf16"] = hf16(ids).logits[:, -1].float().argmax(-1)
        del hf16
        hf32 = hf_model(
            LLAMA_32_1B,
            {k: v.float() for k, v in state.items()},
            torch.float32,
            LlamaConfig,
            LlamaForCausalLM,
        )
        ref = hf32(ids).logits[:, -1].double()
    best = ref.max(-1).values
    for name, tokens in firsts.items():
        margins = best - ref.gather(-1, tokens[:, None])[:, 0]
        result[f"{name}_first_token_agree_fp32_of_16"] = int((margins == 0).sum())
        result[f"{name}_max_fp32_logit_margin"] = round(float(margins.max()), 4)
    top2 = ref.topk(2, dim=-1).values
    result["fp32_top2_gap_median"] = round(float((top2[:, 0] - top2[:, 1]).median()), 4)


def _fp8_section(result: dict[str, Any]) -> None:
    from bench.gpu_fp8 import fp8_weights

    fp8_weights(result)


def _moe_section(result: dict[str, Any], quick: bool) -> None:
    from bench.gpu_moe import moe

    moe(result, quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--quick", action="store_true", help="small workload (smoke test)")
    parser.add_argument("--sections", default="copy,parity,kernels,8b,1b,agree")
    args = parser.parse_args()
    import triton

    result: dict[str, Any] = {
        "bench": "gpu",
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": __import__("transformers").__version__,
    }
    out_dir = os.environ.get("OUT")
    sections: dict[str, Callable[[], None]] = {
        "copy": lambda: result.update(copy_bandwidth()),
        "parity": lambda: result.update(parity()),
        "kernels": lambda: kernels(result),
        "8b": lambda: eight_b(result),
        "agree": lambda: agreement(result),
        "1b": lambda: one_b(result, args.quick),
        "fp8": lambda: _fp8_section(result),
        "moe": lambda: _moe_section(result, args.quick),
    }
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            sections[name]()
        except Exception:  # a failed section is reported and the rest still run
            result[f"error_{name}"] = traceback.format_exc()[-1500:]
            traceback.print_exc()
        result[f"section_seconds_{name}"] = round(time.perf_counter() - t0, 1)
        torch.cuda.empty_cache()
        print(f"[{name}] done in {result[f'section_seconds_{name}']} s", flush=True)
        if out_dir:
            Path(out_dir, "bench_gpu.json").write_text(json.dumps(result, indent=1))
    targets = {
        "engine_vs_sweep>=0.88": result.get("engine_vs_sweep", 0) >= 0.88,
        "ratio>=8": result.get("throughput_ratio_vs_hf_1b", 0) >= 8,
        "baton_tok_s>=30000": result.get("baton_tokens_per_s_1b", 0) >= 30000,
    }
    result["targets_met"] = targets
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
