"""Megatron-style parallel layers, each with a pluggable quantization method.

Layers (``N`` ranks, see `model.parallel` for the split):

* `ColumnParallelLinear`: output features split; a merged layer (``gate_up_proj``) holds the
  rank's share of every part, parts side by side. No collective.
* `QKVParallelLinear`: the merged q/k/v projection split by heads (KV heads replicated when
  ``N`` exceeds them). No collective.
* `RowParallelLinear`: input features split; one all-reduce of the partial products, the bias
  added once after it.
* `VocabParallelEmbedding`: vocabulary rows split; out-of-shard ids contribute zeros and one
  all-reduce sums the ranks. `logits` is the (tied or separate) LM head: each rank computes its
  vocabulary columns and one all-gather joins them.

A `LinearMethod` owns what a linear layer's weights are: `create_weights` registers the
parameters (each with a `ParamSharding` saying how it maps onto its checkpoint tensor),
`process_weights_after_loading` may convert them once every checkpoint tensor is in, and
`apply` computes ``x W^T + b``. `UnquantizedLinearMethod` (plain ``F.linear``) is the default;
a quantized method (e.g. FP8) plugs in without changing the layers.

Loading: ``layer.load_weight(param_name, source, part)`` reads only the rank's shard of a
checkpoint tensor (`WeightSource`) into the parameter; ``part`` picks the merged part (q=0, k=1,
v=2; gate=0, up=1) a separate checkpoint tensor fills.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import ClassVar, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from baton_engine.model.parallel import SINGLE, Shard, TensorParallel
from baton_engine.model.weight_source import WeightSource, full_index


@dataclass(frozen=True)
class ParamSharding:
    """How a parameter maps onto the checkpoint tensor(s) it is loaded from."""

    output_dim: int | None = None
    """This dimension runs over the layer's output features: it holds the rank's rows of every
    merged part, parts in order (``None``: not split along outputs)."""
    input_dim: int | None = None
    """This dimension runs over the layer's input features: it holds the rank's input shard."""
    per_part: bool = False
    """Dimension 0 has one entry per merged part, each loaded from that part's scalar tensor
    (e.g. per-tensor scales of q, k and v)."""
    required: bool = True
    """A checkpoint without it is incomplete (False: the method has a default, e.g. a dynamic
    activation scale)."""


class LinearMethod(Protocol):
    """How a linear layer's weights are created, finished after loading, and applied."""

    def create_weights(self, layer: ParallelLinear, dtype: torch.dtype, device: torch.device | str) -> None:
        """Register the layer's parameters with ``layer.add_parameter`` (shapes from
        `ParallelLinear.input_size_per_rank` and `ParallelLinear.output_sizes_per_rank`)."""
        ...

    def process_weights_after_loading(self, layer: ParallelLinear) -> None:
        """Called once after every checkpoint tensor was loaded (e.g. to quantize or transpose)."""
        ...

    def apply(self, layer: ParallelLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [T, in per rank] -> [T, out per rank]``, plus `bias` when given."""
        ...


class UnquantizedLinearMethod:
    """Weights in the model dtype, ``[out, in]`` as checkpoints store them; ``F.linear``."""

    def create_weights(self, layer: ParallelLinear, dtype: torch.dtype, device: torch.device | str) -> None:
        weight = torch.empty(
            layer.output_size_per_rank, layer.input_size_per_rank, dtype=dtype, device=device
        )
        layer.add_parameter("weight", weight, ParamSharding(output_dim=0, input_dim=1))

    def process_weights_after_loading(self, layer: ParallelLinear) -> None:
        pass

    def apply(self, layer: ParallelLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.packed is not None:
            return onednn_linear(x, layer.packed, bias)
        return F.linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()


def onednn_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str = "none",
    *,
    combine: tuple[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x W^T (+ b) with W reordered by ``torch.ops.mkldnn._reorder_linear_weight`` (CPU, oneDNN).

    Element-wise work on the product runs in the matmul's epilogue, while the output is in
    cache, instead of as separate passes over memory: `activation` is a oneDNN unary post-op
    name (``"swish"``: silu), `combine` a binary one with its other operand, shaped like the
    output (``("add", residual)``: ``x W^T + residual``; ``("mul", other)``).

    oneDNN builds (and caches, up to 1024 entries) one primitive per input shape, 0.2-1.8 MiB
    each: with a step's row count changing every step, an engine core grew by hundreds of MiB.
    So the rows are zero-padded to `onednn_rows` (a bounded set of counts) and cut off after."""
    rows = x.shape[0]
    padded = onednn_rows(rows) if x.dim() == 2 else rows
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    out: torch.Tensor
    if combine is None:
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, activation, [], "")
    else:
        if activation != "none":
            raise ValueError("oneDNN linear: an activation and a binary post-op cannot be combined here")
        op, other = combine
        if padded != rows:
            other = F.pad(other, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, bias, op)
    return out if padded == rows else out[:rows]


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN matmul of `rows` rows runs with: up to 8 as is, beyond that
    rounded up to one of 4 counts per power of two (10, 12, 14, 16, 20, 24, 28, 32, 40, ...):
    at most 25 % more rows, 40 distinct counts up to 2048."""
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


class QuantizationConfig(Protocol):
    """Picks each linear layer's method (by its module name, e.g. ``model.layers.0.mlp.down_proj``)."""

    def linear_method(self, prefix: str) -> LinearMethod: ...


def method_for(quantization: QuantizationConfig | None, prefix: str) -> LinearMethod | None:
    """The method of layer `prefix` (None: unquantized)."""
    return None if quantization is None else quantization.linear_method(prefix)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class ParallelLinear(nn.Module):
    """The shared machinery: shards, parameters registered by the method, shard loading.

    `split` picks the features split across ranks: ``"output"`` (column-parallel, each part's
    outputs split evenly) or ``"input"`` (row-parallel); a layer with another split (q/k/v by
    heads) passes its `output_shards`."""

    split: ClassVar[Literal["input", "output"]] = "output"
    weight: torch.Tensor
    """Registered by the method (`UnquantizedLinearMethod`: ``[out per rank, in per rank]``)."""
    bias: torch.Tensor | None

    def __init__(
        self,
        input_size: int,
        output_sizes: int | Sequence[int],
        *,
        bias: bool,
        prefix: str,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: TensorParallel = SINGLE,
        quant_method: LinearMethod | None = None,
        part_names: Sequence[str] = (),
        output_shards: Sequence[Shard] | None = None,
    ) -> None:
        """`output_sizes`: one per merged part (an int: one part); `output_shards`: this rank's
        shard of each part when the split is not even (then the inputs are not split)."""
        output_sizes = (output_sizes,) if isinstance(output_sizes, int) else tuple(output_sizes)
        input_shard = Shard(0, input_size)
        if output_shards is None and self.split == "input":
            input_shard = parallel.even(input_size, f"input features of {prefix}")
            output_shards = [Shard(0, size) for size in output_sizes]
        elif output_shards is None:
            output_shards = [parallel.even(size, f"output features of {prefix}") for size in output_sizes]
        super().__init__()
        self.input_size = input_size
        self.output_sizes = tuple(output_sizes)
        self.input_shard = input_shard
        self.output_shards = tuple(output_shards)
        self.part_names = tuple(part_names)
        """Checkpoint module names of the merged parts (``q_proj``, ``k_proj``, ``v_proj``)."""
        self.parallel = parallel
        self.prefix = prefix
        self.quant_method: LinearMethod = UNQUANTIZED if quant_method is None else quant_method
        self.shardings: dict[str, ParamSharding] = {}
        self.packed: torch.Tensor | None = None
        """The unquantized method's `weight` reordered for oneDNN (`cpu_linear.pack_linears`), or
        None: plain ``F.linear``."""
        self.part_offsets = (0, *accumulate(s.length for s in self.output_shards))
        """Where each part's rows start in this rank's output dimension."""
        self.quant_method.create_weights(self, dtype, device)
        if bias:
            self.add_parameter(
                "bias", torch.empty(self.output_size_per_rank, dtype=dtype, device=device), ParamSharding(0)
            )
        else:
            self.register_parameter("bias", None)

    @property
    def input_size_per_rank(self) -> int:
        return self.input_shard.length

    @property
    def output_sizes_per_rank(self) -> tuple[int, ...]:
        return tuple(s.length for s in self.output_shards)

    @property
    def output_size_per_rank(self) -> int:
        return self.part_offsets[-1]

    @property
    def num_parts(self) -> int:
        return len(self.output_sizes)

    def add_parameter(self, name: str, tensor: torch.Tensor, sharding: ParamSharding) -> None:
        """Register `tensor` as parameter `name`, loaded from the checkpoint as `sharding` says."""
        self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        self.shardings[name] = sharding

    def load_weight(self, name: str, source: WeightSource, part: int | None = None) -> None:
        """Copy this rank's shard of checkpoint tensor `source` into parameter `name`; `part`:
        the merged part the tensor is (None: the layer's single part)."""
        sharding = self.shardings.get(name)
        _check(sharding is not None, f"{self.prefix}: no parameter {name!r} to load")
        assert sharding is not None
        if part is None:
            _check(self.num_parts == 1, f"{self.prefix}.{name}: a merged layer loads one part at a time")
            part = 0
        _check(0 <= part < self.num_parts, f"{self.prefix}.{name}: part {part} outside [0, {self.num_parts})")
        param: torch.Tensor = getattr(self, name).data
        where = f"{self.prefix}.{name}" + (f" ({self.part_names[part]})" if self.part_names else "")
        if sharding.per_part:
            value = source.read()
            _check(value.numel() == 1, f"{where}: expected a scalar, got shape {tuple(value.shape)}")
            param[part].copy_(value.reshape(()))
            return
        shape = source.shape
        dims: dict[int, slice] = {}
        dest = param
        if sharding.input_dim is not None:
            got = shape[sharding.input_dim]
            _check(
                got == self.input_size,
                f"{where}: checkpoint has {got} input features, the model {self.input_size}",
            )
            dims[sharding.input_dim] = slice(self.input_shard.start, self.input_shard.stop)
        if sharding.output_dim is not None:
            got = shape[sharding.output_dim]
            want = self.output_sizes[part]
            _check(got == want, f"{where}: checkpoint has {got} output features, the model {want}")
            shard = self.output_shards[part]
            dims[sharding.output_dim] = slice(shard.start, shard.stop)
            dest = param.narrow(sharding.output_dim, self.part_offsets[part], shard.length)
        tensor = source.read(full_index(shape, dims))
        _check(
            tuple(tensor.shape) == tuple(dest.shape),
            f"{where}: checkpoint shard has shape {tuple(tensor.shape)}, the model's {tuple(dest.shape)}",
        )
        dest.copy_(tensor)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(ParallelLinear):
    """Output features split across ranks; `output_sizes` lists the merged parts (one: unmerged)."""

    split = "output"


class QKVParallelLinear(ColumnParallelLinear):
    """The merged q/k/v projection, split by attention heads (parts: q=0, k=1, v=2)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        prefix: str,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: TensorParallel = SINGLE,
        quant_method: LinearMethod | None = None,
    ) -> None:
        heads = parallel.even(num_heads, "attention heads (num_attention_heads)")
        kv_heads = parallel.kv_heads(num_kv_heads)
        q = Shard(heads.start * head_dim, heads.length * head_dim)
        kv = Shard(kv_heads.start * head_dim, kv_heads.length * head_dim)
        super().__init__(
            hidden_size,
            (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim),
            bias=bias,
            prefix=prefix,
            dtype=dtype,
            device=device,
            parallel=parallel,
            quant_method=quant_method,
            part_names=("q_proj", "k_proj", "v_proj"),
            output_shards=(q, kv, kv),
        )
        self.head_dim = head_dim
        self.num_local_heads = heads.length
        self.num_local_kv_heads = kv_heads.length
        self.kv_head_shard = kv_heads
        """The KV heads this rank holds (the KV cache's heads, in this order)."""


class RowParallelLinear(ParallelLinear):
    """Input features split across ranks; the partial products are summed by one all-reduce."""

    split = "input"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b``, plus `residual` when given (on one rank with oneDNN, in the matmul's
        epilogue)."""
        if not self.parallel.is_parallel:
            if residual is not None and self.packed is not None:
                return onednn_linear(x, self.packed, self.bias, combine=("add", residual))
            out = self.quant_method.apply(self, x, self.bias)
        else:
            out = self.parallel.all_reduce(self.quant_method.apply(self, x, None))
            out = out if self.bias is None else out + self.bias
        return out if residual is None else residual + out


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary split across ranks; also the LM head (`logits`)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        prefix: str,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.prefix = prefix
        self.parallel = parallel
        self.shard, self.rows_per_rank = parallel.vocab(vocab_size)
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def load_weight(self, name: str, source: WeightSource, part: int | None = None) -> None:
        _check(name == "weight" and part is None, f"{self.prefix}: no parameter {name!r} to load")
        shape, want = tuple(source.shape), (self.vocab_size, self.weight.shape[1])
        _check(shape == want, f"{self.prefix}.weight: checkpoint shape {shape}, the model's {want}")
        rows = self.shard.length
        self.weight.data[:rows].copy_(source.read((slice(self.shard.start, self.shard.stop),)))
        self.weight.data[rows:].zero_()  # padding rows: zero embeddings, logits cut off

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.is_parallel:
            return F.embedding(ids, self.weight)
        local = ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.length)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(out)

    def logits(self, hidden: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, hidden] -> [T, vocab]`` (every rank gets the whole row); `packed`: this rank's
        `weight` reordered for oneDNN (CPU)."""
        local = F.linear(hidden, self.weight) if packed is None else onednn_linear(hidden, packed, None)
        if not self.parallel.is_parallel:
            return local
        return self.parallel.all_gather_last_dim(local)[..., : self.vocab_size]
