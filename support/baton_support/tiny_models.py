"""The one factory of tiny random-weight models for tests and benchmarks.

A `TinyModel` names what to build (family, sizes, seed, dtype, extras); `build()` returns the
transformers model in memory (the reference the engine is compared with), `save(directory)`
writes it as a Hugging Face folder (config.json + model.safetensors, and with
``chat_tokenizer=True`` a trained byte-level BPE tokenizer and a chat template) that the engine
loads like any checkpoint. Weights are deterministic: ``torch.manual_seed(seed)`` before the
model is constructed, so a spec always gives the same weights on every machine.

Presets for the shapes the suites share sit at the bottom (`PARITY`, `SPECULATIVE`, `CHAT`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_EOS = "<|im_end|>"
_CHAT_CORPUS = (
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Hello world! How are you today? I am fine, thank you. " * 4,
    "def add(a, b):\n    return a + b\n" * 4,
    "Paris is the capital of France. Berlin is the capital of Germany. " * 4,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@dataclass(frozen=True)
class TinyModel:
    """What to build. Every field has the value most tests want; presets below override some."""

    family: Family = "llama"
    """llama | qwen2 (q/k/v biases, rope theta 1000) | qwen3 (q/k norms, head_dim 32, tied
    embeddings, rope theta 1000) | qwen3_moe (qwen3's attention, untied; 8 experts of width
    `hidden_size`, top 2; layer 1 dense when there are several) | mixtral (llama's attention,
    rope theta 1e6; 4 experts of width 2 * `hidden_size`, top 2)."""
    vocab_size: int = 300
    """Token ids are ``[0, vocab_size)``; with `chat_tokenizer` the trained tokenizer's size wins
    (this is only its target)."""
    hidden_size: int = 64
    """The MLP is twice as wide; 4 attention heads share `num_kv_heads` KV heads."""
    num_kv_heads: int = 2
    num_layers: int = 2
    max_positions: int = 512
    """``max_position_embeddings``: the engine caps ``max_model_len`` by it."""
    init_range: float = 0.2
    """``initializer_range``: larger weights give peakier logits (greedy loops, confident samples)."""
    eos_token_id: int | None = None
    """The config's EOS; None: the model never stops on its own (tests set ``max_tokens``)."""
    llama3_rope: bool = False
    """llama only: llama3 rope scaling (exercises the engine's scaled rotary table)."""
    random_norms: bool = False
    """Norm weights around 1 and biases around 0 drawn at random (transformers initialises them
    to exactly 1 and 0, which would hide a norm or bias the engine forgot)."""
    chat_tokenizer: bool = False
    """Also train a byte-level BPE tokenizer (special tokens `CHAT_SPECIAL_TOKENS`, EOS
    `CHAT_EOS`) with `CHAT_TEMPLATE`, for tests of the text path."""
    norm_topk_prob: bool = True
    """qwen3_moe only: renormalise the top-k routing weights (Qwen3-MoE's config flag)."""
    dtype: Literal["float64", "float32"] = "float64"
    """Weights as saved and built (float64 makes engine-vs-transformers parity exact enough to
    compare greedy tokens)."""
    seed: int = 0

    def replace(self, **changes: Any) -> TinyModel:
        return dataclasses.replace(self, **changes)

    def hf_config(self, vocab_size: int | None = None, eos_token_id: int | None = None) -> Any:
        """The transformers config (the model class's own `config_class`)."""
        from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

        common: dict[str, Any] = dict(
            vocab_size=self.vocab_size if vocab_size is None else vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=2 * self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=4,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_positions,
            rms_norm_eps=1e-6,
            initializer_range=self.init_range,
            bos_token_id=None,
            eos_token_id=self.eos_token_id if eos_token_id is None else eos_token_id,
            pad_token_id=None,
        )
        if self.family == "llama":
            if self.llama3_rope:
                common["rope_parameters"] = _LLAMA3_ROPE
            return LlamaConfig(**common, tie_word_embeddings=False)
        if self.llama3_rope:
            raise ValueError(f"llama3_rope: only for family llama, not {self.family}")
        if self.family == "qwen2":
            return Qwen2Config(**common, tie_word_embeddings=False, rope_parameters={"rope_theta": 1000.0})
        if self.family == "qwen3":
            return Qwen3Config(
                **common, head_dim=32, tie_word_embeddings=True, rope_parameters={"rope_theta": 1000.0}
            )
        if self.family == "qwen3_moe":
            moe = Qwen3MoeConfig(
                **common,
                tie_word_embeddings=False,
                rope_parameters={"rope_theta": 1000.0},
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=self.hidden_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[1] if self.num_layers > 1 else [],
            )
            moe.head_dim = 32  # a config attribute its typed signature does not list
            return moe
        if self.family == "mixtral":
            return MixtralConfig(
                **common, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2
            )
        raise ValueError(f"family: {self.family!r} is not llama, qwen2, qwen3, qwen3_moe or mixtral")

    def build(self, *, vocab_size: int | None = None, eos_token_id: int | None = None) -> torch.nn.Module:
        """The transformers model in memory, in eval mode (`vocab_size` / `eos_token_id` override
        the spec's: `save` passes the trained tokenizer's)."""
        import torch
        from transformers import (
            LlamaForCausalLM,
            MixtralForCausalLM,
            Qwen2ForCausalLM,
            Qwen3ForCausalLM,
            Qwen3MoeForCausalLM,
        )

        model_class = {
            "llama": LlamaForCausalLM,
            "qwen2": Qwen2ForCausalLM,
            "qwen3": Qwen3ForCausalLM,
            "qwen3_moe": Qwen3MoeForCausalLM,
            "mixtral": MixtralForCausalLM,
        }
        config = self.hf_config(vocab_size, eos_token_id)
        torch.manual_seed(self.seed)
        model: torch.nn.Module = model_class[self.family](config)
        if self.random_norms:
            _randomise_norms_and_biases(model, torch.Generator().manual_seed(self.seed + 1))
        return model.to(getattr(torch, self.dtype)).eval()

    def save(self, directory: Path) -> torch.nn.Module:
        """Write the model (and its tokenizer) to `directory` as a Hugging Face folder; returns the
        model as built (the reference for parity checks)."""
        directory.mkdir(parents=True, exist_ok=True)
        vocab_size = eos = None
        if self.chat_tokenizer:
            vocab_size, eos = _save_chat_tokenizer(directory, self.vocab_size)
        model = self.build(vocab_size=vocab_size, eos_token_id=eos)
        model.save_pretrained(directory)  # type: ignore[operator]
        return model


def _randomise_norms_and_biases(model: torch.nn.Module, generator: torch.Generator) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1)
            elif "norm" in name:
                param.copy_(1.0 + torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.2)


def _save_chat_tokenizer(directory: Path, vocab_size: int) -> tuple[int, int]:
    """Train and save the tokenizer; returns (its vocabulary size, the EOS id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CHAT_CORPUS, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {
        "eos_token": CHAT_EOS,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    eos = tokenizer.token_to_id(CHAT_EOS)
    assert eos is not None  # a special token of the trainer
    return tokenizer.get_vocab_size(), eos


def with_eos(source: Path, target: Path, eos_token_id: int) -> Path:
    """A copy of saved model `source` (weights linked, not copied) whose config names
    `eos_token_id` as EOS."""
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (target / item.name).symlink_to(item.resolve())
    config = json.loads((source / "config.json").read_text())
    config["eos_token_id"] = eos_token_id
    (target / "config.json").write_text(json.dumps(config))
    return target


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of one prompt (batch of one, no padding, no EOS)."""
    import torch

    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :].tolist()]


PARITY = TinyModel(num_layers=3, llama3_rope=True, random_norms=True)
"""Engine-vs-transformers parity (tests/model, tests/gpu*): every family, norms and biases random.
Use ``PARITY.replace(family=...)`` (llama3 rope is llama's: pass ``llama3_rope=False`` for qwen)."""

SPECULATIVE = TinyModel(vocab_size=16)
"""n-gram speculation: a vocabulary this small makes greedy outputs loop, so drafts hit often
enough for long accepted runs and miss often enough for rollbacks."""

CHAT = TinyModel(vocab_size=320, max_positions=1024, dtype="float32", chat_tokenizer=True)
"""Server tests: a real tokenizer and chat template in front of gibberish, generated fast."""


def parity_model(family: Family, seed: int = 0) -> TinyModel:
    """`PARITY` for `family` (the llama3 rope scaling only where the family has it)."""
    return PARITY.replace(family=family, llama3_rope=family == "llama", seed=seed)
