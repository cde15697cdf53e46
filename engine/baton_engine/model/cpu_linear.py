"""CPU matmuls through oneDNN with weights reordered once (PyTorch's own mkldnn ops).

On CPU, `F.linear` goes to the BLAS PyTorch was built with (MKL in the PyPI wheels), which runs
its generic code on AMD CPUs: measured on an AMD EPYC (AVX-512), oneDNN with pre-reordered
weights is 2.5-3.4x faster for 4..2048 rows (the same library vLLM-CPU uses). Float32 and
bfloat16 only (oneDNN has no float64 matmul), bfloat16 only where the CPU has oneDNN's bfloat16
instructions; elsewhere layers keep `F.linear`.
"""

from __future__ import annotations

from typing import TypeGuard

import torch

from baton_engine.model.layers import GatedMLP
from baton_engine.model.linear import ParallelLinear, UnquantizedLinearMethod
from baton_engine.model.llama import CausalLM

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(model: CausalLM) -> bool:
    weight = model.model.embed_tokens.weight
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
        and (weight.dtype != torch.bfloat16 or onednn_bf16_supported())
    )


def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bfloat16 matmuls on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses to reorder a bfloat16 weight elsewhere (an AVX2-only CPU)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: CausalLM) -> int:
    """Reorder every unquantized linear weight (and the LM head's) for oneDNN; returns how many.
    A gated MLP's gate and up weights are reordered apart (`GatedMLP.gate_packed`), so that
    each product is contiguous for silu and the multiply in place. Idempotent. Layers of other
    (quantized) methods keep their own kernels."""
    if not can_pack(model):
        return 0
    count = 0
    with torch.inference_mode():
        split: set[ParallelLinear] = set()
        for module in model.modules():
            if isinstance(module, GatedMLP) and _unquantized(module.gate_up_proj):
                split.add(module.gate_up_proj)
                if module.gate_packed is None or module.up_packed is None:
                    gate, up = module.gate_up_proj.weight.detach().chunk(2)
                    module.gate_packed = torch.ops.mkldnn._reorder_linear_weight(gate.contiguous())
                    module.up_packed = torch.ops.mkldnn._reorder_linear_weight(up.contiguous())
                    count += 2
        for module in model.modules():
            if _unquantized(module) and module not in split and module.packed is None:
                module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
                count += 1
        if model.logits_packed is None:
            head = model.lm_head_layer.weight
            model.logits_packed = torch.ops.mkldnn._reorder_linear_weight(head.detach())
            count += 1
    return count


def _unquantized(module: torch.nn.Module) -> TypeGuard[ParallelLinear]:
    return isinstance(module, ParallelLinear) and isinstance(module.quant_method, UnquantizedLinearMethod)
