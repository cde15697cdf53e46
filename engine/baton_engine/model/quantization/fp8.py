"""FP8 numerics: the two E4M3 formats, scales, quantize / dequantize, and the reference GEMM.

Two 8-bit float formats share the name E4M3 (4 exponent bits, 3 mantissa bits):

* ``float8_e4m3fn`` (OCP): exponent bias 7, max 448, no infinities, one NaN pattern per sign.
  NVIDIA (sm_89 and later), AMD CDNA4 (gfx950: MI350X/MI355X) and checkpoints use it.
* ``float8_e4m3fnuz``: exponent bias 8, max 240, no negative zero (0x80 is the only NaN). AMD CDNA3
  (gfx940/941/942: MI300X/MI325X) computes in it. The same bits read as fnuz are worth half their
  fn value, so an fn checkpoint becomes fnuz by re-reading its bits and doubling its scales
  (`to_fnuz`), after mapping fn's negative zero (0x80, NaN in fnuz) to zero.

A quantized tensor is ``q`` (FP8) and a float32 scale with ``value ~= q * scale``. Weights carry one
scale per tensor or per output channel; activations one per tensor (static, from calibration) or
one per token (dynamic, from the row's largest magnitude). Rounding is round-to-nearest-even with
saturation at the format's max, as torch's cast does after the clamp.
"""

from __future__ import annotations

from typing import Literal

import torch

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

#: AMD architectures whose matrix cores compute in float8_e4m3fnuz (CDNA3).
FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")

#: How activations entering an FP8 GEMM are quantized: "static" one calibrated per-tensor scale
#: from the checkpoint; "dynamic" one scale per token computed on the fly; "none" not at all (the
#: weights are dequantized into the activations' 16-bit dtype: weight-only FP8).
ActivationScheme = Literal["static", "dynamic", "none"]

#: Rows (tokens) up to which an FP8 linear layer multiplies weight-only, its activations kept
#: 16-bit whatever its scheme: batch-1 decode, the engine's decode-product bucket
#: (`triton_gemv.GEMV_ENGINE_MAX_TOKENS`). Such a product is bound by the weight bytes: on a GPU it
#: reads the FP8 weight (1 byte a weight), widens it in registers and applies the per-channel
#: scale in the epilogue, with no activation-quantization launch, and it is closer to the 16-bit
#: model than W8A8.
FP8_DECODE_MAX_ROWS = 1

#: The smallest scale a dynamic quantization uses (an all-zero row would otherwise divide by 0).
MIN_SCALE = 1e-12


def fp8_dtype_for_arch(arch: str) -> torch.dtype:
    """The FP8 format a device computes in: fnuz on CDNA3 ("gfx942"...), OCP fn elsewhere
    ("sm_90", "gfx950", and the CPU, whose reference path reads either)."""
    return torch.float8_e4m3fnuz if arch.split(":")[0] in FNUZ_ARCHS else torch.float8_e4m3fn


def fp8_dtype_for_device(device: torch.device) -> torch.dtype:
    """The FP8 format of `device`: ROCm builds of torch name AMD GPUs "cuda" and set
    `torch.version.hip`; their architecture ("gfx942:sramecc+:xnack-") decides."""
    if device.type != "cuda" or not torch.version.hip:
        return torch.float8_e4m3fn
    return fp8_dtype_for_arch(str(torch.cuda.get_device_properties(device).gcnArchName))


def fp8_max(dtype: torch.dtype) -> float:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{dtype} is not an FP8 format (expected one of {FP8_DTYPES})")
    return float(torch.finfo(dtype).max)


def cast_saturated(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` (already divided by its scale) clamped to the format's range and rounded into it."""
    limit = fp8_max(dtype)
    return x.clamp(-limit, limit).to(dtype)


def quantize_weight(
    weight: torch.Tensor, dtype: torch.dtype, per_channel: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [out, in] weight -> (q, scale): scale [out] (per output channel) or [] (per tensor),
    each the block's largest magnitude over the format's max."""
    w32 = weight.to(torch.float32)
    amax = w32.abs().amax(dim=1) if per_channel else w32.abs().amax()
    scale = amax.clamp(min=MIN_SCALE) / fp8_max(dtype)
    divisor = scale[:, None] if per_channel else scale
    return cast_saturated(w32 / divisor, dtype), scale


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: [M, K] -> (q [M, K], scale [M] float32)."""
    x32 = x.to(torch.float32)
    scale = x32.abs().amax(dim=-1).clamp(min=MIN_SCALE) / fp8_max(dtype)
    return cast_saturated(x32 / scale[:, None], dtype), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Static activation quantization with a calibrated per-tensor `scale` ([] float32)."""
    return cast_saturated(x.to(torch.float32) / scale, dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of `q`: scale [] (per tensor) or [rows] (per row)."""
    q32 = q.to(torch.float32)
    return q32 * (scale[:, None] if scale.dim() == 1 else scale)


def to_fnuz(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An OCP-fn tensor and its scale re-expressed in fnuz: the same bits, the scale doubled."""
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected a float8_e4m3fn tensor, got {q.dtype}")
    bits = q.view(torch.int8).clone()
    bits[bits == -128] = 0  # fn's negative zero is fnuz's NaN
    return bits.view(torch.float8_e4m3fnuz), scale * 2.0


def channel_scales(scales: list[torch.Tensor], rows: list[int]) -> torch.Tensor:
    """One per-output-channel scale vector for weights fused along their output dim (q/k/v,
    gate/up): a part's per-tensor scale is repeated over its rows, a per-channel one kept. The
    fused weight's values are unchanged (no requantization)."""
    parts = []
    for scale, count in zip(scales, rows, strict=True):
        flat = scale.to(torch.float32).reshape(-1)
        if flat.numel() == 1:
            parts.append(flat.expand(count))
        elif flat.numel() == count:
            parts.append(flat)
        else:
            raise ValueError(f"weight_scale: {flat.numel()} values for a weight of {count} rows")
    return torch.cat(parts)


def quantize_activation(
    x: torch.Tensor, scheme: ActivationScheme, input_scale: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (q, per-row scale [M]) under `scheme` ("static" or "dynamic")."""
    if scheme == "dynamic":
        return quantize_per_token(x, dtype)
    if scheme == "static":
        if input_scale is None:
            raise ValueError("static activation quantization needs an input_scale")
        scale = input_scale.to(torch.float32).reshape(())
        return quantize_static(x, scale, dtype), scale.expand(x.shape[0])
    raise ValueError(f"activation scheme {scheme!r} does not quantize activations")


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    scheme: ActivationScheme,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ b) with an FP8 weight ([N, K], scale [N]), on any device (the CPU path).

    Activations are quantized exactly as the GPU kernels quantize them, then both operands are
    dequantized and multiplied in float32: the products of FP8 values are exact in float32, so this
    is the kernels' arithmetic up to the order of the sums.
    """
    w = dequantize(weight, weight_scale)
    if scheme == "none":
        a = x.to(torch.float32)
    else:
        q, scale = quantize_activation(x.reshape(-1, x.shape[-1]), scheme, input_scale, weight.dtype)
        a = dequantize(q, scale).reshape(x.shape)
    y = torch.nn.functional.linear(a, w, None if bias is None else bias.to(torch.float32))
    return y.to(x.dtype)
