"""`bench.gpu` section "moe": the Qwen3-30B-A3B shape (random weights, bfloat16) at 64 and 256
concurrent requests.

For each concurrency: Baton's output tokens per second and transformers' on the same weights
(transformers' parameters are views of the engine's: one copy of the ~57 GiB on the device; its
default experts implementation, ``grouped_mm`` where torch has it), then the
device time of Baton's captured decode step at that batch against the roofline of the bytes the
step must read: every active expert's weights (the experts the step's tokens were routed to,
counted per layer by an eager run of the same step), the attention, router and LM-head weights,
and the batch's KV cache, at the copy bandwidth measured in the same run (or the H200's 4.8 TB/s).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from baton_engine.model.config import ModelConfig
from baton_engine.model.llama import CausalLM
from baton_engine.model.moe import SparseMoeBlock, route
from bench.gpu import cuda_time_ms, make_core, run_requests
from bench.shapes import QWEN3_30B_A3B

H200_BANDWIDTH_GBPS = 4800.0


def moe_random_weights(
    config: ModelConfig, dtype: torch.dtype, seed: int, device: str = "cuda"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights, experts already stacked (transformers 5's in-memory names), made one
    layer at a time as the loader reads them (the device never holds them twice)."""
    assert config.moe is not None
    moe = config.moe
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * 0.02).to(dtype)

    def norm(size: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(size, generator=gen, device=device)).to(dtype)

    h, d, e, i = config.hidden_size, config.head_dim, moe.num_experts, moe.moe_intermediate_size
    yield from {
        "model.embed_tokens.weight": normal(config.vocab_size, h),
        "model.norm.weight": norm(h),
        "lm_head.weight": normal(config.vocab_size, h),
    }.items()
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        yield from {
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": normal(config.num_heads * d, h),
            p + "self_attn.k_proj.weight": normal(config.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": normal(config.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": normal(h, config.num_heads * d),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate.weight": normal(e, h),
            p + "mlp.experts.gate_up_proj": normal(e, 2 * i, h),
            p + "mlp.experts.down_proj": normal(e, h, i),
        }.items()


def hf_state_from_engine(model: CausalLM) -> dict[str, torch.Tensor]:
    """transformers' Qwen3-MoE state dict as views of one-rank engine `model`'s parameters
    (q/k/v: row ranges of the merged projection)."""
    config = model.config
    d = config.head_dim
    state = {
        "model.embed_tokens.weight": model.model.embed_tokens.weight,
        "model.norm.weight": model.model.norm.weight,
    }
    state["lm_head.weight"] = model.lm_head_layer.weight
    for index, layer in enumerate(model.model.decoder_layers()):
        p = f"model.layers.{index}."
        attn = layer.self_attn
        q, k, v = attn.qkv_proj.weight.split(
            [config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d]
        )
        assert attn.q_norm is not None and attn.k_norm is not None
        mlp = layer.mlp
        assert isinstance(mlp, SparseMoeBlock)
        state |= {
            p + "input_layernorm.weight": layer.input_layernorm.weight,
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": attn.o_proj.weight,
            p + "self_attn.q_norm.weight": attn.q_norm.weight,
            p + "self_attn.k_norm.weight": attn.k_norm.weight,
            p + "mlp.gate.weight": mlp.gate.weight,
            p + "mlp.experts.gate_up_proj": mlp.experts.gate_up_proj,
            p + "mlp.experts.down_proj": mlp.experts.down_proj,
        }
    return state


def hf_qwen3_moe(config: ModelConfig, weights: dict[str, torch.Tensor], device: str = "cuda") -> Any:
    """transformers' Qwen3-MoE holding `weights` (no copy: built on the meta device, then assigned)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    assert config.moe is not None
    cfg = Qwen3MoeConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe.moe_intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_experts=config.moe.num_experts,
        num_experts_per_tok=config.moe.num_experts_per_tok,
        norm_topk_prob=config.moe.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    missing = model.load_state_dict(weights, strict=False, assign=True).missing_keys
    assert not missing, missing[:3]
    with torch.device(device):
        model.model.rotary_emb = Qwen3MoeRotaryEmbedding(cfg)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval().requires_grad_(False)


def _active_experts(runner: Any, batch: int) -> list[int]:
    """Experts each layer's router picks for the tokens of the captured batch-`batch` graph's
    inputs (one eager run of the same step, hooks counting the distinct ids)."""
    counts: list[int] = []

    def count(block: torch.nn.Module, args: tuple[torch.Tensor, ...], _: object) -> None:
        assert isinstance(block, SparseMoeBlock)
        _, ids = route(args[0], block.gate.weight, block.config)
        counts.append(int(ids.unique().numel()))

    hooks = [
        layer.mlp.register_forward_hook(count)
        for layer in runner.model.model.layers
        if isinstance(layer.mlp, SparseMoeBlock)
    ]
    try:
        runner._decode_forward(batch, runner._graphs[batch].meta)
        torch.cuda.synchronize()
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def moe(result: dict[str, Any], quick: bool) -> None:
    config = QWEN3_30B_A3B
    assert config.moe is not None
    n_in, n_out = (64, 16) if quick else (256, 128)
    concurrency = (64, 256)
    weights = moe_random_weights(config, torch.bfloat16, seed=3)
    core, runner = make_core(
        config, weights, torch.bfloat16, (1, 8, 16, 32, 64, 128, 256), max_num_seqs=256,
        max_model_len=1024, max_num_batched_tokens=8192, gpu_memory_utilization=0.75,
        enable_prefix_caching=False,
    )  # fmt: skip
    result["moe_kv_blocks"] = runner.num_blocks
    weight_bytes = sum(w.numel() * w.element_size() for w in runner.model.parameters())
    result["moe_weight_gib"] = round(weight_bytes / 2**30, 2)
    rng = np.random.default_rng(9)
    run_requests(core, [rng.integers(0, config.vocab_size, size=40).tolist() for _ in range(8)], [8] * 8)
    hf = hf_qwen3_moe(config, hf_state_from_engine(runner.model))
    result["moe_hf_experts_implementation"] = str(hf.config._experts_implementation)
    bandwidth = float(result.get("copy_bandwidth_gbps") or H200_BANDWIDTH_GBPS)
    moe_cfg = config.moe
    expert_bytes = 3 * config.hidden_size * moe_cfg.moe_intermediate_size * 2
    dense_bytes = sum(
        p.numel() * p.element_size()
        for name, p in runner.model.named_parameters()
        if ".experts." not in name and "embed_tokens" not in name
    )
    kv_per_token = runner.kv_cache[:, :, 0, 0].numel() * runner.kv_cache.element_size()
    for n in concurrency:
        prompts = [rng.integers(0, config.vocab_size, size=n_in).tolist() for _ in range(n)]
        run_requests(core, prompts, [2] * n)  # compiles this workload's prefill and MoE tiles
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        baton = run_requests(core, prompts, [n_out] * n)
        elapsed = time.perf_counter() - t0
        assert sum(len(v) for v in baton.values()) == n * n_out
        result[f"moe_baton_tokens_per_s_c{n}"] = round(n * n_out / elapsed, 1)
        ids = torch.tensor(prompts, device="cuda")
        hf.generate(
            ids[:4, :16], attention_mask=torch.ones_like(ids[:4, :16]), max_new_tokens=2, do_sample=False
        )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n_out,
            min_new_tokens=n_out,
            do_sample=False,
        )
        torch.cuda.synchronize()
        hf_elapsed = time.perf_counter() - t0
        result[f"moe_hf_tokens_per_s_c{n}"] = round((out.shape[1] - n_in) * n / hf_elapsed, 1)
        result[f"moe_ratio_vs_hf_c{n}"] = round(
            result[f"moe_baton_tokens_per_s_c{n}"] / result[f"moe_hf_tokens_per_s_c{n}"], 2
        )
        first_agree = sum(int(out[i, n_in]) == baton[f"r{i}"][0] for i in range(min(n, 32)))
        result[f"moe_hf_first_token_agree_of_{min(n, 32)}_c{n}"] = first_agree
        # The captured decode step at batch n, every row at the workload's mean context.
        ctx = n_in + n_out // 2
        blocks = -(-ctx // runner.block_size)
        runner._g_seq_lens[:n].fill_(ctx)
        runner._g_slots[:n].fill_(-1)
        runner._g_pos[:n].fill_(ctx - 1)
        runner._g_ids[:n].copy_(torch.tensor([p[-1] for p in prompts], device="cuda"))
        runner._g_tables[:n, :blocks].copy_(
            torch.arange(n * blocks, device="cuda", dtype=torch.int32).view(n, blocks) % runner.num_blocks
        )
        active = _active_experts(runner, n)
        step_ms = statistics.median(cuda_time_ms(runner._graphs[n].graph.replay, 20))
        step_bytes = sum(active) * expert_bytes + dense_bytes + n * ctx * kv_per_token
        roofline_ms = step_bytes / (bandwidth * 1e9) * 1e3
        result[f"moe_decode_graph_ms_c{n}"] = round(step_ms, 3)
        result[f"moe_active_experts_per_layer_c{n}"] = round(sum(active) / len(active), 1)
        result[f"moe_step_bytes_gib_c{n}"] = round(step_bytes / 2**30, 3)
        result[f"moe_roofline_ms_c{n}"] = round(roofline_ms, 3)
        result[f"moe_roofline_fraction_c{n}"] = round(roofline_ms / step_ms, 3)
    result["moe_bandwidth_gbps_used"] = bandwidth
