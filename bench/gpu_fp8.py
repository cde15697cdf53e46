"""`bench.gpu` section "fp8": FP8 weights against bfloat16 on the same random Llama-3.1-8B-shape
weights, one GPU.

The FP8 engine quantizes every decoder linear layer on load (`--quantization fp8`: one scale
per output channel, activations quantized per token; the embeddings and the LM head stay 16-bit).
Reported: the batch-1 decode step of each (engine step and captured-graph replay; the goal is
FP8 <= 0.6x bf16, the weight bytes read per step halving), and on 8 random prompts the
first-token agreement and the largest and mean gap between the two models' last-position logits.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from baton_engine.core.engine_core import EngineCore
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.model.quantization.fp8 import fp8_dtype_for_device
from baton_engine.model.quantization.fp8_linear import Fp8Quantization
from baton_engine.worker.gpu.model_runner import GpuModelRunner
from baton_support.model_logits import prefill_logits
from bench.gpu import LLAMA_31_8B, cuda_time_ms, make_core, random_weights

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


def fp8_weights(result: dict[str, Any]) -> None:
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
    result["fp8_format"] = str(quantization.fp8_dtype).removeprefix("torch.")
    result["fp8_weight_gib_8b"] = round(
        sum(p.numel() * p.element_size() for p in fp8_runner.model.parameters()) / 2**30, 2
    )
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, size=512).tolist()
    bf16_step, bf16_graph = _b1_step_ms(bf16_core, bf16_runner, prompt, "bf16")
    fp8_step, fp8_graph = _b1_step_ms(fp8_core, fp8_runner, prompt, "fp8")
    result["fp8_b1_decode_ms_8b"] = round(fp8_step, 3)
    result["fp8_b1_decode_graph_ms_8b"] = round(fp8_graph, 3)
    result["fp8_bf16_b1_decode_ms_8b"] = round(bf16_step, 3)
    result["fp8_bf16_b1_decode_graph_ms_8b"] = round(bf16_graph, 3)
    result["fp8_vs_bf16_step"] = round(fp8_step / bf16_step, 3)
    result["fp8_vs_bf16_graph"] = round(fp8_graph / bf16_graph, 3)
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
