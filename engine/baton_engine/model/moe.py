"""The sparse mixture-of-experts block (Qwen3-MoE, Mixtral): a top-k router and E gated MLPs.

Routing, exactly as transformers does it for both families: router logits ``x W_g^T`` in the
model dtype, softmax over all experts in float32, the top k probabilities, renormalised to sum to
1 when `MoeConfig.norm_topk_prob` (always for Mixtral; Qwen3-MoE's config says), then cast back to
the model dtype unless `MoeConfig.routing_in_float32` (Mixtral keeps them in float32, so the
expert output is scaled in float32 before it is summed in the model dtype). Neither family has a
shared expert.

The experts' weights are stacked: ``experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows)
and ``experts.down_proj`` [E, H, I], as transformers 5 holds them. FP8 experts (an FP8 checkpoint's,
or quantized on load with ``--quantization fp8``) keep one float32 scale per (expert, output
channel); they always multiply weight-only (activations stay 16-bit, on every path), whatever
activation scheme the checkpoint names: a checkpoint's per-tensor scale is repeated over its
rows and its experts' ``input_scale`` tensors are not read. Two paths compute the block:
`experts_reference` (torch; CPU and tests: the pairs sorted by expert, one product per expert that
has pairs, summed in expert order as transformers does) and `kernels.triton_moe.fused_moe` (GPU:
grouped GEMMs, no loop over experts on the host).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from baton_engine.model.config import MoeConfig
from baton_engine.model.parallel import SINGLE, TensorParallel
from baton_engine.model.quantization import fp8
from baton_engine.model.quantization.fp8_config import Fp8Checkpoint, UnsupportedQuantizationError
from baton_engine.model.quantization.fp8_linear import Fp8Quantization
from baton_engine.model.weight_source import WeightSource

if TYPE_CHECKING:
    from baton_engine.model.layers import BuildContext

#: Which implementation computes the experts: the torch reference, or the Triton kernels
#: ("auto": Triton on GPU devices, the reference elsewhere).
MoeImplementation = Literal["auto", "torch", "triton"]

#: A checkpoint tensor of the experts: one expert's gate, up or down projection, or (stacked)
#: every expert's gate_up or down.
ExpertPart = Literal["gate", "up", "down", "gate_up"]


def route(
    hidden: torch.Tensor, router_weight: torch.Tensor, config: MoeConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [T, K], expert ids [T, K]) of each token (see the module docstring)."""
    logits = F.linear(hidden, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, config.num_experts_per_tok, dim=-1)
    if config.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not config.routing_in_float32:
        weights = weights.to(logits.dtype)
    return weights, ids


def experts_reference(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """Each token's routed experts' outputs, weighted and summed: [T, H] (16/32-bit weights)."""
    out = torch.zeros_like(hidden)
    num_experts = gate_up.shape[0]
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(hidden[tokens], gate_up[expert]).chunk(2, dim=-1)
        result = F.linear(F.silu(gate) * up, down[expert])
        result = result * weights.reshape(-1)[pairs, None]
        out.index_add_(0, tokens, result.to(out.dtype))
    return out


class TopKRouter(nn.Module):
    """The router's [E, H] weight (replicated on every tensor-parallel rank)."""

    def __init__(
        self, num_experts: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype, device=device), requires_grad=False
        )


class StackedExperts(nn.Module):
    """This rank's share of E gated MLPs as two stacked weights (16-bit, or FP8 with
    per-(expert, channel) scales): ``gate_up_proj`` [E, 2 I_r, H] (the rank's gate rows, then its up
    rows) and ``down_proj`` [E, H, I_r], where I_r is the rank's even shard of the intermediate
    size: sharded like `layers.GatedMLP` (gate/up by output rows, down by input columns), so the
    block's output is a partial sum that one all-reduce completes."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.shard = parallel.even(intermediate_size, "moe_intermediate_size")
        local = self.shard.length
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, local, dtype=dtype, device=device), requires_grad=False
        )
        self.gate_up_scale: torch.Tensor | None = None
        self.down_scale: torch.Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return self.gate_up_scale is not None

    def expect_fp8_checkpoint(self) -> None:
        """Hold the checkpoint's FP8 weights as stored (float8_e4m3fn, the format checkpoints use)
        and their scales: `load_scale` fills them, expert by expert."""
        gate_up, down = self.gate_up_proj, self.down_proj
        self.gate_up_proj = nn.Parameter(
            torch.empty(gate_up.shape, dtype=torch.float8_e4m3fn, device=gate_up.device), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(down.shape, dtype=torch.float8_e4m3fn, device=down.device), requires_grad=False
        )
        self.gate_up_scale = torch.empty(gate_up.shape[:2], dtype=torch.float32, device=gate_up.device)
        self.down_scale = torch.empty(down.shape[:2], dtype=torch.float32, device=down.device)

    def load_projection(self, kind: ExpertPart, expert: int | None, source: WeightSource, where: str) -> None:
        if self.is_fp8 and expert is None:
            raise UnsupportedQuantizationError(
                f"{where}: stacked expert tensors in an FP8 checkpoint are not supported "
                "(per-expert gate/up/down tensors with their weight_scale are)"
            )
        self._load_projection(kind, expert, _ExpectDtype(source, where, fp8=self.is_fp8), where)

    def load_scale(self, kind: ExpertPart, expert: int, source: WeightSource, where: str) -> None:
        """One expert projection's ``weight_scale``: per tensor ([] or [1]: repeated over the
        rows) or per output channel ([rows, 1] or [rows]; gate/up: this rank's rows)."""
        assert self.gate_up_scale is not None and self.down_scale is not None
        values = int(torch.Size(source.shape).numel())
        if kind == "down":
            dest, rows, index = self.down_scale[expert], self.down_scale.shape[1], slice(None)
        else:
            local, start = self.shard.length, self.shard.start
            half = 0 if kind == "gate" else 1
            dest = self.gate_up_scale[expert, half * local : (half + 1) * local]
            rows, index = self.intermediate_size, slice(start, start + local)
        if values == 1:
            dest.fill_(float(source.read().reshape(())))
        elif values == rows and source.shape[0] == rows:
            dest.copy_(source.read((index,)).reshape(-1))
        else:
            raise ValueError(
                f"{where}: shape {tuple(source.shape)}, expected a per-tensor scale ([] or [1]) or one "
                f"per output channel ([{rows}, 1])"
            )

    def _load_projection(
        self, kind: ExpertPart, expert: int | None, source: WeightSource, where: str
    ) -> None:
        """Copy this rank's shard of one checkpoint tensor: one expert's ``gate``/``up`` [I, H] or
        ``down`` [H, I] (`expert` its index), or every expert's stacked ``gate_up`` [E, 2I, H] /
        ``down`` [E, H, I] (`expert` None: transformers 5's in-memory layout)."""
        num_experts, hidden = self.down_proj.shape[0], self.down_proj.shape[1]
        inter, local, start = self.intermediate_size, self.shard.length, self.shard.start
        rows = slice(start, start + local)
        if kind == "down":
            dest = self.down_proj.data if expert is None else self.down_proj.data[expert]
            if expert is None:
                _check_shape(source, (num_experts, hidden, inter), where)
                dest.copy_(source.read((slice(0, num_experts), slice(0, hidden), rows)))
            else:
                _check_shape(source, (hidden, inter), where)
                dest.copy_(source.read((slice(0, hidden), rows)))
            return
        if expert is None:  # stacked gate_up: gate rows [0, I), up rows [I, 2I)
            _check_shape(source, (num_experts, 2 * inter, hidden), where)
            for half in (0, 1):
                first = half * inter + start
                part = source.read((slice(0, num_experts), slice(first, first + local)))
                self.gate_up_proj.data[:, half * local : (half + 1) * local].copy_(part)
            return
        _check_shape(source, (inter, hidden), where)
        half = 0 if kind == "gate" else 1
        self.gate_up_proj.data[expert, half * local : (half + 1) * local].copy_(source.read((rows,)))

    def set_fp8(
        self, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor
    ) -> None:
        """Replace the weights by FP8 ones: scales [E, 2I] and [E, H] (float32)."""
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)
        self.gate_up_scale = gate_up_scale
        self.down_scale = down_scale

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) in `dtype` (FP8 weights dequantized; the reference path's operands)."""
        if self.gate_up_scale is None or self.down_scale is None:
            return self.gate_up_proj, self.down_proj
        gate_up = (self.gate_up_proj.to(torch.float32) * self.gate_up_scale[..., None]).to(dtype)
        down = (self.down_proj.to(torch.float32) * self.down_scale[..., None]).to(dtype)
        return gate_up, down


class SparseMoeBlock(nn.Module):
    """Router + experts; module names follow the checkpoints (``mlp.gate``, ``mlp.experts``).

    It loads its own checkpoint tensors (`weights.CheckpointModule`): each expert's gate, up and
    down projection under the family's names (`CHECKPOINT_NAMES`), or the stacked ones."""

    def __init__(
        self, ctx: BuildContext, prefix: str, config: MoeConfig, implementation: MoeImplementation = "auto"
    ) -> None:
        super().__init__()
        self.config = config
        self.implementation = implementation
        self.parallel = ctx.parallel
        hidden = ctx.config.hidden_size
        self.gate = TopKRouter(config.num_experts, hidden, ctx.dtype, ctx.device)
        self.experts = StackedExperts(
            config.num_experts, hidden, config.moe_intermediate_size, ctx.dtype, ctx.device, ctx.parallel
        )
        self._names = _checkpoint_names(prefix, ctx.config.family, config.num_experts)
        quantization = ctx.quantization
        self._fp8_on_load: torch.dtype | None = None
        """The FP8 format to quantize the experts into after loading (``--quantization fp8``)."""
        self._fp8_checkpoint: torch.dtype | None = None
        """The device's FP8 format, when the checkpoint stores the experts in FP8."""
        if isinstance(quantization, Fp8Quantization):
            if quantization.quantize_on_load:
                self._fp8_on_load = quantization.fp8_dtype
            elif quantization.checkpoint is not None and _experts_are_fp8(
                quantization.checkpoint, self._names
            ):
                self._fp8_checkpoint = quantization.fp8_dtype
                self.experts.expect_fp8_checkpoint()
                self._names.update(_scale_names(self._names))

    def uses_triton(self, device: torch.device) -> bool:
        if self.implementation == "auto":
            return device.type == "cuda"
        return self.implementation == "triton"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = route(hidden, self.gate.weight, self.config)
        experts = self.experts
        if self.uses_triton(hidden.device):
            from baton_engine.model.kernels.triton_moe import fused_moe

            out = fused_moe(
                hidden, experts.gate_up_proj, experts.down_proj, weights, ids,
                experts.gate_up_scale, experts.down_scale,
            )  # fmt: skip
        else:
            gate_up, down = experts.dequantized(hidden.dtype)
            out = experts_reference(hidden, gate_up, down, weights, ids)
        return self.parallel.all_reduce(out)

    # -- weights.CheckpointModule
    def checkpoint_names(self) -> dict[str, Hashable]:
        return {name: key for name, key in self._names.items()}

    def load_checkpoint_tensor(self, key: Hashable, source: WeightSource, name: str) -> None:
        kind, expert = cast(tuple[str, int | None], key)
        if kind == "router":
            _check_shape(source, tuple(self.gate.weight.shape), name)
            self.gate.weight.data.copy_(_ExpectDtype(source, name, fp8=False).read())
            return
        if kind.endswith("_scale"):
            assert expert is not None
            self.experts.load_scale(cast(ExpertPart, kind.removesuffix("_scale")), expert, source, name)
            return
        self.experts.load_projection(cast(ExpertPart, kind), expert, source, name)

    def process_weights_after_loading(self) -> None:
        """FP8 experts: a checkpoint's re-expressed in the device's format (fnuz on MI300: the
        same bits, doubled scales), or 16-bit ones quantized on load, one scale per (expert,
        output channel)."""
        experts = self.experts
        if self._fp8_checkpoint is not None:
            assert experts.gate_up_scale is not None and experts.down_scale is not None
            if self._fp8_checkpoint == torch.float8_e4m3fnuz:
                gate_up, gate_up_scale = fp8.to_fnuz(experts.gate_up_proj.data, experts.gate_up_scale)
                down, down_scale = fp8.to_fnuz(experts.down_proj.data, experts.down_scale)
                experts.set_fp8(gate_up, gate_up_scale, down, down_scale)
            return
        if self._fp8_on_load is None:
            return
        gate_up, down = experts.gate_up_proj.data, experts.down_proj.data
        q_gate_up, gate_up_scale = fp8.quantize_weight(
            gate_up.reshape(-1, gate_up.shape[2]), self._fp8_on_load
        )
        q_down, down_scale = fp8.quantize_weight(down.reshape(-1, down.shape[2]), self._fp8_on_load)
        experts.set_fp8(
            q_gate_up.view(gate_up.shape), gate_up_scale.view(gate_up.shape[:2]),
            q_down.view(down.shape), down_scale.view(down.shape[:2]),
        )  # fmt: skip

    def missing_checkpoint_names(self, loaded: set[Hashable]) -> list[str]:
        by_key = {key: name for name, key in self._names.items()}
        missing = [] if ("router", None) in loaded else [by_key[("router", None)]]
        stacked = {"gate_up": ("gate_up", None) in loaded, "down": ("down", None) in loaded}
        for expert in range(self.config.num_experts):
            for kind in ("gate", "up", "down"):
                whole = stacked["down" if kind == "down" else "gate_up"]
                if not whole and (kind, expert) not in loaded:
                    missing.append(by_key[(kind, expert)])
                if self._fp8_checkpoint is not None and (f"{kind}_scale", expert) not in loaded:
                    missing.append(by_key[(f"{kind}_scale", expert)])
        return missing


#: Checkpoint module names of expert `{e}`'s gate, up and down projections and of the router,
#: under a sparse layer's prefix (``model.layers.N.``), per family.
CHECKPOINT_NAMES: dict[str, tuple[str, str, str, str]] = {
    "qwen3_moe": (
        "mlp.experts.{e}.gate_proj",
        "mlp.experts.{e}.up_proj",
        "mlp.experts.{e}.down_proj",
        "mlp.gate",
    ),
    "mixtral": (
        "block_sparse_moe.experts.{e}.w1",
        "block_sparse_moe.experts.{e}.w3",
        "block_sparse_moe.experts.{e}.w2",
        "block_sparse_moe.gate",
    ),
}


def _checkpoint_names(prefix: str, family: str, num_experts: int) -> dict[str, tuple[str, int | None]]:
    """Checkpoint name -> (projection, expert) for the block at `prefix` (``model.layers.N.mlp``)."""
    layer = prefix.rpartition(".")[0] + "."
    gate_name, up_name, down_name, router_name = CHECKPOINT_NAMES[family]
    names: dict[str, tuple[str, int | None]] = {f"{layer}{router_name}.weight": ("router", None)}
    for expert in range(num_experts):
        for kind, pattern in (("gate", gate_name), ("up", up_name), ("down", down_name)):
            names[f"{layer}{pattern.format(e=expert)}.weight"] = (kind, expert)
    names[f"{prefix}.experts.gate_up_proj"] = ("gate_up", None)
    names[f"{prefix}.experts.down_proj"] = ("down", None)
    return names


def _experts_are_fp8(checkpoint: Fp8Checkpoint, names: dict[str, tuple[str, int | None]]) -> bool:
    """Whether the checkpoint's quantization_config makes the experts FP8 (one stacked weight has
    one dtype, so every expert projection must agree)."""
    modules = [name.removesuffix(".weight") for name, (_, expert) in names.items() if expert is not None]
    schemes = {module: checkpoint.scheme_for(module) for module in modules}
    fp8_modules = sorted(module for module, scheme in schemes.items() if scheme is not None)
    if fp8_modules and len(fp8_modules) < len(modules):
        plain = sorted(set(modules) - set(fp8_modules))
        raise UnsupportedQuantizationError(
            f"quantization_config: some expert projections are FP8 ({fp8_modules[0]}) and some 16-bit "
            f"({plain[0]}); a layer's experts must all be one or the other"
        )
    return bool(fp8_modules)


def _scale_names(names: dict[str, tuple[str, int | None]]) -> dict[str, tuple[str, int | None]]:
    """The ``weight_scale`` name of every per-expert projection in `names` -> ("<kind>_scale", e)."""
    return {
        f"{name.removesuffix('.weight')}.weight_scale": (f"{kind}_scale", expert)
        for name, (kind, expert) in names.items()
        if expert is not None
    }


class _ExpectDtype:
    """`source`, refusing a tensor of the wrong kind: an FP8 tensor copied into a 16-bit weight
    would lose its scale, a 16-bit one copied into an FP8 weight would be rounded without one."""

    def __init__(self, source: WeightSource, where: str, fp8: bool) -> None:
        self.source = source
        self.where = where
        self.fp8 = fp8

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    def read(self, index: tuple[slice, ...] = ()) -> torch.Tensor:
        tensor = self.source.read(index)
        if self.fp8 and tensor.dtype != torch.float8_e4m3fn:
            raise UnsupportedQuantizationError(
                f"{self.where}: a {tensor.dtype} tensor where the quantization_config makes the experts "
                "FP8 (float8_e4m3fn)"
            )
        if not self.fp8 and tensor.dtype in fp8.FP8_DTYPES:
            raise UnsupportedQuantizationError(
                f"{self.where}: an FP8 tensor ({tensor.dtype}) where the model expects 16 bits (the "
                "checkpoint's quantization_config leaves it unquantized, or there is none)"
            )
        return tensor


def _check_shape(source: WeightSource, want: tuple[int, ...], where: str) -> None:
    if tuple(source.shape) != tuple(want):
        raise ValueError(f"{where}: checkpoint shape {tuple(source.shape)}, the model's {tuple(want)}")
