"""A tiny random-weight Llama with a real byte-level BPE tokenizer and chat template.

Generates gibberish quickly: for server tests that need text plumbing but not meaningful text.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Hello world! How are you today? I am fine, thank you. " * 4,
    "def add(a, b):\n    return a + b\n" * 4,
    "Paris is the capital of France. Berlin is the capital of Germany. " * 4,
]


def make_tiny_chat_model(directory: Path, vocab_size: int = 320, max_positions: int = 1024) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
                "add_bos_token": False,
            }
        )
    )
    eos = tokenizer.token_to_id("<|im_end|>")
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory)
    return directory
