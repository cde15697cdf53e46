"""`bench.gpu` section "fp8": FP8 weights against bfloat16 on the same random Llama-3.1-8B-shape
weights, one GPU.

The FP8 engine quantizes every decoder linear layer on load (`--quantization fp8`: one scale
per output channel, activations quantized per token; the embeddings and the LM head stay 16-bit).
Reported: the batch-1 decode step of each (engine step and captured-graph replay; the goal is
FP8 <= 0.6x bf16, the weight bytes read per step halving; both against their physical limit,
the bytes a step reads at the measured copy bandwidth), and on 8 random prompts the first-token
agreement and the largest and mean gap between the two models' last-position logits: what the
format costs on random weights, not a check of the kernels.

The kernels are checked against the FP8 model's own torch arithmetic on the same GPU (the CPU
path's: dequantized float32 operands, the layers' ``gemm="reference"``): 64-token prompts (W8A8:
per-token activation quantization, ``torch._scaled_mm``) and one-token prompts (the weight-only
decode product), agreement and largest logit gap of each, and one layer's product on the same
input (largest error relative to the largest output).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import numpy as np
import torch

from baton_engine.core.engine_core import EngineCore
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.model.kernels.triton_fp8 import fp8_gemv_table
from baton_engine.model.kernels.triton_gemv import GemvLaunch, GemvTable
from baton_engine.model.linear import ParallelLinear
from baton_engine.model.quantization.fp8 import fp8_dtype_for_device
from baton_engine.model.quantization.fp8_linear import Fp8LinearMethod, Fp8Quantization
from baton_engine.worker.gpu.fused_decoder import FusedDecoder
from baton_engine.worker.gpu.model_runner import GpuModelRunner
from baton_support.model_logits import prefill_logits
from bench.gpu import (
    LLAMA_31_8B,
    b1_forward,
    cuda_time_ms,
    graph_kernel_us,
    graph_ms,
    make_core,
    random_weights,
)

PROMPTS = 8


def _b1_step_ms(
    core: EngineCore, runner: GpuModelRunner, prompt: list[int], request_id: str
) -> tuple[float, float]:
    """(median engine step, median batch-1 graph replay) of one 512-token request's decode."""
    core.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
    core.step()  # prefill + first token
    times = []
    while core.has_unfinished():
        t0 = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - t0) * 1e3)
    graph_ms = statistics.median(cuda_time_ms(runner._graphs[1].graph.replay, 20))
    return statistics.median(times[8:]), graph_ms


#: One-token FP8 launches tried per call site by `tune_fp8_products` (block_n, block_k, warps,
#: stages): the shipped entry first, then its neighbours in tile rows, columns, warps and stages
#: (under PDL a product's first tile streams in before its wait, so the best tile depends on
#: the kernels around it).
TUNE_CANDIDATES: dict[str, tuple[tuple[int, int, int, int], ...]] = {
    "gate_up": ((2, 1024, 2, 2), (2, 512, 2, 2), (1, 1024, 2, 2), (2, 1024, 1, 2), (1, 2048, 2, 2),
                (4, 512, 2, 2), (2, 1024, 2, 3), (4, 1024, 2, 2)),
    "down": ((8, 2048, 8, 2), (16, 2048, 8, 2), (8, 4096, 8, 2), (16, 1024, 8, 2), (8, 2048, 8, 3),
             (8, 1024, 8, 2), (4, 2048, 4, 2)),
    "qkv": ((4, 1024, 4, 2), (8, 1024, 4, 2), (4, 1024, 8, 2), (8, 512, 4, 2), (8, 1024, 8, 2),
            (4, 512, 4, 2), (2, 1024, 4, 2)),
    "o": ((8, 2048, 8, 2), (16, 2048, 8, 2), (8, 4096, 8, 1), (16, 1024, 8, 2), (8, 1024, 8, 2),
          (16, 4096, 8, 1), (4, 2048, 4, 2)),
}  # fmt: skip


def tune_fp8_products(
    result: dict[str, Any], runner: GpuModelRunner, bf16_runner: GpuModelRunner, context: int = 552
) -> None:
    """Each call site's one-token FP8 launch chosen by the whole batch-1 forward it runs in (the
    products, attention and LM head replayed from one graph with PDL, `context` positions), one
    site at a time with the others at their best so far: a product's cost depends on how its
    first tiles overlap its neighbours' tails, which no product timed alone shows. Reported per
    site: each candidate's forward ms and its logits' relative difference from the shipped
    table's; then the shipped and tuned tables' forwards interleaved, against bf16's forward."""
    forwards: dict[str, Any] = {}
    for name, run in (("fp8", runner), ("bf16", bf16_runner)):
        decoder = FusedDecoder(run.model, run.fused.gemv_table)
        forwards[name] = (decoder, b1_forward(run, context, decoder))
    decoder, forward = forwards["fp8"]
    shipped = decoder.projection_table
    reference = forward().float()

    def measure(table: GemvTable) -> tuple[float, float]:
        decoder.projection_table = table
        err = float((forward().float() - reference).norm() / reference.norm())
        return graph_ms(forward, 20), err

    best = shipped
    report: dict[str, Any] = {}
    for site, candidates in TUNE_CANDIDATES.items():
        timed: dict[str, Any] = {}
        chosen: tuple[float, GemvTable] | None = None
        for block_n, block_k, warps, stages in candidates:
            launch = GemvLaunch(block_n, block_k, warps, stages, False, "bench.gpu_fp8 tuning")
            table = best.replaced(best.name, {(site, 1): launch})
            key = f"n{block_n}_k{block_k}_w{warps}_s{stages}"
            try:
                ms, err = measure(table)
            except Exception as exc:  # a launch that fails to compile is reported, not fatal
                timed[key] = repr(exc)[:120]
                continue
            timed[key] = (round(ms, 4), round(err, 5))
            if err < 0.02 and (chosen is None or ms < chosen[0]):
                chosen = (ms, table)
        if chosen is not None:
            best = chosen[1]
        report[site] = {"forward_ms_err": timed, "best": dataclasses.asdict(best.launch(site, 1))}
    result["fp8_tune_8b"] = report
    rounds: dict[str, list[float]] = {"shipped": [], "tuned": [], "bf16": []}
    for _ in range(3):
        rounds["shipped"].append(measure(shipped)[0])
        rounds["tuned"].append(measure(best)[0])
        rounds["bf16"].append(graph_ms(forwards["bf16"][1], 20))
    medians = {k: statistics.median(v) for k, v in rounds.items()}
    result["fp8_tune_forward_ms_8b"] = {k: [round(x, 4) for x in v] for k, v in rounds.items()}
    result["fp8_tune_forward_vs_bf16_shipped"] = round(medians["shipped"] / medians["bf16"], 4)
    result["fp8_tune_forward_vs_bf16_tuned"] = round(medians["tuned"] / medians["bf16"], 4)
    decoder.projection_table = shipped


def fp8_weights(result: dict[str, Any], tune: bool = False) -> None:
    config = LLAMA_31_8B
    weights = random_weights(config, torch.bfloat16, "cuda", seed=1)
    settings: dict[str, Any] = dict(
        max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=1024, num_kv_blocks=600
    )
    bf16_core, bf16_runner = make_core(config, weights, torch.bfloat16, (1,), **settings)
    quantization = Fp8Quantization(None, fp8_dtype_for_device(torch.device("cuda")))
    fp8_core, fp8_runner = make_core(
        config, weights, torch.bfloat16, (1,), quantization=quantization, **settings
    )
    del weights
    torch.cuda.empty_cache()
    copy_bps = result.get("copy_bandwidth_gbps", 0.0) * 1e9
    result["fp8_format"] = str(quantization.fp8_dtype).removeprefix("torch.")
    result["fp8_weight_gib_8b"] = round(
        sum(p.numel() * p.element_size() for p in fp8_runner.model.parameters()) / 2**30, 2
    )
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, size=512).tolist()
    if tune:
        tune_fp8_products(result, fp8_runner, bf16_runner)
        assert fp8_runner.fused.projection_table is fp8_gemv_table(torch.device("cuda"))
    bf16_step, bf16_graph = _b1_step_ms(bf16_core, bf16_runner, prompt, "bf16")
    fp8_step, fp8_graph = _b1_step_ms(fp8_core, fp8_runner, prompt, "fp8")
    result["fp8_b1_decode_ms_8b"] = round(fp8_step, 3)
    result["fp8_b1_decode_graph_ms_8b"] = round(fp8_graph, 3)
    result["fp8_bf16_b1_decode_ms_8b"] = round(bf16_step, 3)
    result["fp8_bf16_b1_decode_graph_ms_8b"] = round(bf16_graph, 3)
    result["fp8_vs_bf16_step"] = round(fp8_step / bf16_step, 3)
    result["fp8_vs_bf16_graph"] = round(fp8_graph / bf16_graph, 3)
    for name, runner in (("fp8", fp8_runner), ("fp8_bf16", bf16_runner)):
        try:  # the b1 graph as the last step left it: where each step's time goes
            result[f"{name}_b1_graph_kernels_us_8b"] = graph_kernel_us(runner._graphs[1].graph.replay)
        except Exception as exc:  # a figure to find the time, not one of the section's results
            result[f"{name}_b1_graph_kernels_failed"] = repr(exc)[:300]
    for name, runner, replay_ms in (("fp8", fp8_runner, fp8_graph), ("fp8_bf16", bf16_runner, bf16_graph)):
        step_bytes = _step_bytes(runner)
        result[f"{name}_step_gib_8b"] = round(step_bytes / 2**30, 3)
        if copy_bps:
            limit_ms = step_bytes / copy_bps * 1e3
            result[f"{name}_b1_limit_ms_8b"] = round(limit_ms, 3)
            result[f"{name}_b1_graph_vs_limit_8b"] = round(replay_ms / limit_ms, 3)
    agree, gaps, references = 0, [], []
    for _ in range(PROMPTS):
        tokens = rng.integers(0, config.vocab_size, size=64).tolist()
        want = prefill_logits(bf16_runner.model, tokens)[-1].float()
        got = prefill_logits(fp8_runner.model, tokens)[-1].float()
        agree += int(want.argmax() == got.argmax())
        gaps.append((got - want).abs())
        references.append(want)
    gap = torch.stack(gaps)
    result[f"fp8_first_token_agree_of_{PROMPTS}"] = agree
    result["fp8_max_logit_gap"] = round(float(gap.max()), 4)
    result["fp8_mean_logit_gap"] = round(float(gap.mean()), 5)
    result["fp8_bf16_logit_std"] = round(float(torch.stack(references).std()), 4)  # the gaps' scale
    _kernels_vs_reference(result, fp8_runner, rng, config.vocab_size)


def _step_bytes(runner: GpuModelRunner) -> int:
    """Bytes of weights a decode step reads: every parameter but the embedding table (one row)."""
    embed = runner.model.model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in runner.model.parameters() if p is not embed)


def _kernels_vs_reference(
    result: dict[str, Any],
    runner: GpuModelRunner,
    rng: np.random.Generator,
    vocab_size: int,
) -> None:
    """The FP8 model's kernels against its torch reference arithmetic, same weights, same GPU."""
    methods = {
        m.quant_method
        for m in runner.model.modules()
        if isinstance(m, ParallelLinear) and isinstance(m.quant_method, Fp8LinearMethod)
    }
    assert methods, "the FP8 model has no FP8 layers"
    prompts = {
        "w8a8": [rng.integers(0, vocab_size, size=64).tolist() for _ in range(PROMPTS)],
        "gemv": [rng.integers(0, vocab_size, size=1).tolist() for _ in range(PROMPTS)],
    }
    # One layer on the same input: the kernels' arithmetic against the reference's, without the
    # 32 layers in between (whose bf16 rounding differences per-token quantization turns into
    # whole FP8 steps: the model-level gaps above include that amplification).
    layer = runner.model.model.layers[0].self_attn.qkv_proj
    gen = torch.Generator(device="cuda").manual_seed(3)
    width = layer.weight.shape[1]
    for name, rows in (("w8a8", 64), ("gemv", 1)):
        x = torch.randn(rows, width, generator=gen, device="cuda").to(torch.bfloat16)
        with torch.no_grad():
            got = layer(x).float()
            for method in methods:
                method.gemm = "reference"
            try:
                want = layer(x).float()
            finally:
                for method in methods:
                    method.gemm = "auto"
        relative = (got - want).abs().max() / want.abs().max()
        result[f"fp8_{name}_layer_vs_reference_max_rel_err"] = round(float(relative), 6)
    for name, batch in prompts.items():
        agree, gap = 0, 0.0
        for tokens in batch:
            got = prefill_logits(runner.model, tokens)[-1].float()
            for method in methods:
                method.gemm = "reference"
            try:
                want = prefill_logits(runner.model, tokens)[-1].float()
            finally:
                for method in methods:
                    method.gemm = "auto"
            agree += int(want.argmax() == got.argmax())
            gap = max(gap, float((got - want).abs().max()))
        result[f"fp8_{name}_vs_reference_agree_of_{PROMPTS}"] = agree
        result[f"fp8_{name}_vs_reference_max_logit_gap"] = round(gap, 4)
