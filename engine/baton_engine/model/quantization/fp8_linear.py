"""FP8 linear layers: the quantization method of `model.linear`'s parallel layers.

`Fp8Quantization` picks each layer's method: for an FP8 checkpoint, from its
``quantization_config`` (`fp8_config.Fp8Checkpoint`: 16-bit layers stay unquantized); with
``--quantization fp8``, every linear layer of the decoder is quantized on load (the embeddings
and the LM head are not linear layers here, and stay 16-bit).

`Fp8LinearMethod` holds, after loading: ``weight`` [out, in] in the device's FP8 format,
``weight_scale`` [out] float32 (per-tensor checkpoint scales of merged parts become one scale per
output channel, so merging never requantizes), and for static activations ``input_scale`` []
(the largest of the merged parts': it bounds every part's range). Its `apply`:

* on the CPU, the reference path (`fp8.fp8_linear_reference`: activations quantized as the GPU
  does, both operands dequantized, one float32 product);
* on a GPU, activations quantized by `kernels.triton_fp8.quantize_rows` (per token, or with the
  static scale), then ``torch._scaled_mm`` with row-wise scales where the device takes it
  (bfloat16 out), else the Triton GEMM (`kernels.triton_fp8.fp8_gemm`); weight-only layers
  (no activation scheme) go to the Triton GEMM with 16-bit activations.

Inputs of at most `fp8.FP8_DECODE_MAX_ROWS` rows (batch-1 decode) are multiplied weight-only on every
device whatever the scheme (`arithmetic_for_rows`): on a GPU through the decode product
(`kernels.triton_fp8.fp8_weight_gemv` with the launch of the layer's call site in the fused
decoder, so both sum a row in one order; 1 byte read a weight, no quantization launch), on the CPU
through the reference's weight-only branch, so both compute the same thing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal, cast

import torch
from torch import nn

from baton_engine.model.linear import UNQUANTIZED, LinearMethod, ParallelLinear, ParamSharding
from baton_engine.model.quantization import fp8
from baton_engine.model.quantization.fp8_config import Fp8Checkpoint, Fp8Scheme

#: How an FP8 GEMM runs on a GPU: "auto" (torch._scaled_mm where the device supports row-wise
#: scales, else Triton), or one of the two; "reference" runs the CPU path's torch arithmetic on
#: the GPU too (dequantized float32 operands: what `bench.gpu` checks the kernels against).
GemmBackend = Literal["auto", "scaled_mm", "triton", "reference"]

#: The checkpoint modules a merged layer of the decoder is made of.
MERGED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

#: Quantize-on-load: one weight scale per output channel, activations per token.
ON_LOAD_SCHEME = Fp8Scheme("channel", "dynamic")

#: Architectures whose matrix cores multiply FP8 operands (sm_89+, CDNA3, CDNA4).
_NATIVE_FP8_PREFIXES = ("sm_89", "sm_9", "sm_10", "sm_12", "gfx94", "gfx95")


def checkpoint_parts(prefix: str) -> list[str]:
    """The checkpoint module names of the engine's layer `prefix` (merged layers: their parts)."""
    parent, _, name = prefix.rpartition(".")
    parts = MERGED_PARTS.get(name)
    if parts is None:
        return [prefix]
    return [f"{parent}.{part}" if parent else part for part in parts]


@dataclass(frozen=True)
class Fp8Quantization:
    """The model's FP8 layout: a checkpoint's, or quantize-on-load (`checkpoint` None)."""

    checkpoint: Fp8Checkpoint | None
    fp8_dtype: torch.dtype
    """The device's format (`fp8.fp8_dtype_for_device`)."""
    gemm: GemmBackend = "auto"
    _methods: dict[Fp8Scheme, Fp8LinearMethod] = field(default_factory=dict, compare=False, repr=False)

    @property
    def quantize_on_load(self) -> bool:
        return self.checkpoint is None

    def scheme_for(self, prefix: str) -> Fp8Scheme | None:
        """How layer `prefix` is stored (None: 16-bit)."""
        if self.checkpoint is None:
            return ON_LOAD_SCHEME
        return self.checkpoint.merged_scheme(checkpoint_parts(prefix))

    def linear_method(self, prefix: str) -> LinearMethod:
        scheme = self.scheme_for(prefix)
        if scheme is None:
            return UNQUANTIZED
        method = self._methods.get(scheme)
        if method is None:
            method = self._methods[scheme] = Fp8LinearMethod(
                scheme, self.fp8_dtype, self.quantize_on_load, self.gemm
            )
        return method


class Fp8LinearMethod:
    """Creates, finishes and applies one FP8 linear layer (see the module docstring)."""

    def __init__(
        self, scheme: Fp8Scheme, fp8_dtype: torch.dtype, quantize_on_load: bool, gemm: GemmBackend
    ) -> None:
        self.scheme = scheme
        self.fp8_dtype = fp8_dtype
        self.quantize_on_load = quantize_on_load
        self.gemm = gemm

    # -- loading ----------------------------------------------------------------------------
    def create_weights(self, layer: ParallelLinear, dtype: torch.dtype, device: torch.device | str) -> None:
        rows, cols = layer.output_size_per_rank, layer.input_size_per_rank
        if self.quantize_on_load:
            weight = torch.empty(rows, cols, dtype=dtype, device=device)
            layer.add_parameter("weight", weight, ParamSharding(output_dim=0, input_dim=1))
            return
        # Checkpoints store OCP e4m3fn; MI300's fnuz is derived after loading.
        weight = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device)
        layer.add_parameter("weight", weight, ParamSharding(output_dim=0, input_dim=1))
        if self.scheme.weight_strategy == "tensor":
            scale = torch.empty(layer.num_parts, dtype=torch.float32, device=device)
            layer.add_parameter("weight_scale", scale, ParamSharding(per_part=True))
        else:  # compressed-tensors' per-channel scales: [out, 1]
            scale = torch.empty(rows, 1, dtype=torch.float32, device=device)
            layer.add_parameter("weight_scale", scale, ParamSharding(output_dim=0))
        if self.scheme.activation == "static":
            input_scale = torch.empty(layer.num_parts, dtype=torch.float32, device=device)
            layer.add_parameter("input_scale", input_scale, ParamSharding(per_part=True))

    def process_weights_after_loading(self, layer: ParallelLinear) -> None:
        if self.quantize_on_load:
            weight, scale = fp8.quantize_weight(layer.weight.data, self.fp8_dtype)
            _replace(layer, "weight", weight)
            _replace(layer, "weight_scale", scale)
            return
        raw_scale = cast(torch.Tensor, layer.weight_scale).data
        if self.scheme.weight_strategy == "tensor":
            scale = fp8.channel_scales(list(raw_scale), list(layer.output_sizes_per_rank))
        else:
            scale = raw_scale.reshape(-1)
        weight = layer.weight.data
        input_scale: torch.Tensor | None = None
        if self.scheme.activation == "static":
            input_scale = cast(torch.Tensor, layer.input_scale).data.max()
        if self.fp8_dtype == torch.float8_e4m3fnuz:
            weight, scale = fp8.to_fnuz(weight, scale)
            if input_scale is not None:
                input_scale = input_scale * 2.0
        _replace(layer, "weight", weight)
        _replace(layer, "weight_scale", scale.contiguous())
        if input_scale is not None:
            _replace(layer, "input_scale", input_scale)

    # -- running ----------------------------------------------------------------------------
    def apply(self, layer: ParallelLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = layer.weight
        scale = cast(torch.Tensor, layer.weight_scale)
        input_scale: torch.Tensor | None = getattr(layer, "input_scale", None)
        rows = x.reshape(-1, x.shape[-1])
        activation = arithmetic_for_rows(self.scheme.activation, rows.shape[0])
        if x.device.type != "cuda" or self.gemm == "reference":
            return fp8.fp8_linear_reference(x, weight, scale, activation, input_scale, bias)
        from baton_engine.model.kernels.triton_fp8 import (
            fp8_gemm,
            fp8_weight_gemv,
            quantize_rows,
            site_of_layer,
        )

        if activation == "none" and 0 < rows.shape[0] <= fp8.FP8_DECODE_MAX_ROWS:
            site = site_of_layer(getattr(layer, "prefix", ""))
            out = fp8_weight_gemv(rows, weight, scale, bias, site)
            return out.reshape(*x.shape[:-1], weight.shape[0])
        native = native_fp8_dot(x.device)
        if activation == "none":
            out = fp8_gemm(rows, None, weight, scale, bias, x.dtype, native)
        else:
            q, row_scale = quantize_rows(rows, weight.dtype, input_scale if activation == "static" else None)
            if self._use_scaled_mm(x):
                out = torch._scaled_mm(
                    q,
                    weight.t(),
                    scale_a=row_scale[:, None],
                    scale_b=scale[None, :],
                    bias=bias,
                    out_dtype=x.dtype,
                )
            else:
                out = fp8_gemm(q, row_scale, weight, scale, bias, x.dtype, native)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def _use_scaled_mm(self, x: torch.Tensor) -> bool:
        if self.gemm == "triton" or x.dtype != torch.bfloat16:
            return False
        return self.gemm == "scaled_mm" or scaled_mm_rowwise_works(x.device, self.fp8_dtype)


def arithmetic_for_rows(scheme: fp8.ActivationScheme, rows: int) -> fp8.ActivationScheme:
    """How an FP8 layer multiplies an input of `rows` rows: as its scheme says, except inputs of at
    most `fp8.FP8_DECODE_MAX_ROWS` rows, which stay 16-bit ("none"). Their product is bound by the
    weight bytes, and quantizing the activations would cost a launch per layer for less accuracy."""
    return "none" if rows <= fp8.FP8_DECODE_MAX_ROWS else scheme


def _replace(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Set parameter `name` of `layer` to `tensor` (dtype and shape may change)."""
    if name in layer._parameters:
        del layer._parameters[name]
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def native_fp8_dot(device: torch.device) -> bool:
    """Whether `device`'s Triton dots take FP8 operands (else they are widened to float16)."""
    return _arch(device).startswith(_NATIVE_FP8_PREFIXES)


@functools.cache
def _arch(device: torch.device) -> str:
    properties = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        return str(properties.gcnArchName).split(":")[0]
    return f"sm_{properties.major}{properties.minor}"


@functools.cache
def scaled_mm_rowwise_works(device: torch.device, fp8_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` multiplies `fp8_dtype` with row-wise scales into bfloat16 on
    `device` (CUDA sm_89+ and recent ROCm builds do; others raise): tried once on a small product."""
    a = torch.ones(16, 32, device=device).to(fp8_dtype)
    b = torch.ones(16, 32, device=device).to(fp8_dtype)
    ones = torch.ones(16, 1, device=device)
    try:
        out = torch._scaled_mm(a, b.t(), scale_a=ones, scale_b=ones.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return bool((out == 32).all())
