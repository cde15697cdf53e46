"""Each tensor-parallel rank loads exactly its shard, read lazily from the checkpoint file
(safetensors slices, GGUF rows and blocks), equal to the same slice of the whole tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from baton_engine.model.loader.gguf_loader import GgufSource, open_gguf, read_config, weight_sources
from baton_engine.model.loader.model_loading import load_model
from baton_engine.model.loader.reference import resolve_model
from baton_engine.model.parallel import TensorParallel
from baton_support.tiny_models import parity_model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_every_rank_holds_its_slice_of_the_safetensors_checkpoint(family: str, tmp_path: Path) -> None:
    parity_model(family, seed=2).save(tmp_path)
    full = load_model(str(tmp_path), "cpu", torch.float64).model.state_dict()
    config = load_model(str(tmp_path), "cpu", torch.float64).config
    d, q, kv = config.head_dim, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter, vocab = config.intermediate_size, config.vocab_size
    for size in (2, 4):
        for rank in range(size):
            got = load_model(
                str(tmp_path), "cpu", torch.float64, parallel=TensorParallel(rank, size), load_tokenizer=False
            ).model.state_dict()
            assert got.keys() == full.keys()
            qs = slice(rank * q // size, (rank + 1) * q // size)
            kv_head = rank * config.num_kv_heads // size  # 2 KV heads: split at size 2, replicated at 4
            kvs = slice(kv_head * d, kv_head * d + kv // min(size, config.num_kv_heads))
            inter_s = slice(rank * inter // size, (rank + 1) * inter // size)
            rows = -(-vocab // size)
            for name, value in full.items():
                if "qkv_proj" in name:
                    fq, fk, fv = value.split([q, kv, kv])
                    want = torch.cat([fq[qs], fk[kvs], fv[kvs]])
                elif "gate_up_proj" in name:
                    gate, up = value.chunk(2)
                    want = torch.cat([gate[inter_s], up[inter_s]])
                elif name.endswith("o_proj.weight"):
                    want = value[:, qs]
                elif name.endswith("down_proj.weight"):
                    want = value[:, inter_s]
                elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                    want = torch.zeros(rows, value.shape[1], dtype=value.dtype)
                    part = value[rank * rows : (rank + 1) * rows]
                    want[: len(part)] = part
                else:  # norms and the o_proj bias: whole on every rank
                    want = value
                assert torch.equal(got[name], want), (size, rank, name)


def test_gguf_reads_rows_and_block_aligned_columns_without_the_rest() -> None:
    reader = open_gguf(resolve_model("builtin:smollm2-135m-instruct").path)
    config = read_config(reader)
    sources = dict(weight_sources(reader, config))
    q = sources["model.layers.0.self_attn.q_proj.weight"]  # Q4_1, llama rows permuted per head
    assert isinstance(q, GgufSource) and q.shape == (576, 576)
    whole = q.read()
    assert torch.equal(q.read((slice(192, 384),)), whole[192:384])  # heads 3-5 of 9
    with pytest.raises(ValueError, match="must cover whole heads"):
        q.read((slice(100, 164),))
    down = sources["model.layers.0.mlp.down_proj.weight"]  # [576, 1536], blocks of 32 columns
    whole_down = down.read()
    assert torch.equal(down.read((slice(0, 576), slice(512, 1024))), whole_down[:, 512:1024])
    assert torch.equal(down.read((slice(10, 20), slice(33, 70))), whole_down[10:20, 33:70])
    embed = sources["model.embed_tokens.weight"]  # Q8_0 [49152, 576]
    assert torch.equal(embed.read((slice(16384, 32768),)), embed.read()[16384:32768])
    norm = sources["model.layers.0.input_layernorm.weight"]  # F32 [576]
    assert torch.equal(norm.read((slice(0, 576),)), norm.read())
