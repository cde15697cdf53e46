"""An FP8 KV cache on the reference runner (CPU): what it stores, and outputs that do not depend on
how a prompt reached the cache (prefix hits, chunks)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from baton_engine.config import EngineConfig
from baton_engine.model.quantization.fp8 import cast_saturated
from baton_engine.worker.kv_cache import CPU_KV_CACHE_BYTES, bytes_per_block, kv_cache_scales
from baton_engine.worker.model_runner import ModelRunner
from baton_support.tiny_models import PARITY, parity_model
from tests.model.driver import TestDriver

VOCAB = PARITY.vocab_size


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    parity_model("qwen3", seed=4).replace(dtype="float32").save(directory)
    return directory


def _runner(directory: Path, kv_cache_dtype: str, num_kv_blocks: int | None = 200) -> ModelRunner:
    return ModelRunner(
        EngineConfig(
            model=str(directory), dtype="float32", block_size=4, num_kv_blocks=num_kv_blocks,
            kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
        )
    )  # fmt: skip


def _prompts() -> list[list[int]]:
    rng = random.Random(8)
    shared = [rng.randrange(VOCAB) for _ in range(13)]
    return [shared + [rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 11)] + [
        [rng.randrange(VOCAB) for _ in range(n)] for n in (2, 23)
    ]


def test_fp8_cache_is_one_byte_per_value_scaled_per_layer(tiny_qwen3: Path) -> None:
    runner = _runner(tiny_qwen3, "fp8", num_kv_blocks=None)
    assert runner.kv_cache.dtype == torch.float8_e4m3fn
    assert runner.kv_cache.element_size() == 1
    assert runner.kv_scales is not None and runner.kv_scales.tolist() == [[1.0, 1.0]] * 3
    # A block is a quarter of a float32 one: the CPU budget (4 GiB) holds four times the blocks.
    per_block = bytes_per_block(runner.model_config, 4, runner.kv_dtype)
    assert per_block * 4 == bytes_per_block(runner.model_config, 4, torch.float32) == 3 * 2 * 4 * 2 * 32 * 4
    assert runner.num_blocks == CPU_KV_CACHE_BYTES // per_block
    assert _runner(tiny_qwen3, "auto").kv_scales is None


def test_first_layer_stores_the_rounded_16_bit_values(tiny_qwen3: Path) -> None:
    # Layer 0's K and V depend on the embeddings only, so both runners compute the same values:
    # the FP8 cache holds exactly their FP8 rounding.
    prompt = _prompts()[4]
    exact = _runner(tiny_qwen3, "auto")
    fp8 = _runner(tiny_qwen3, "fp8")
    TestDriver(exact, 64, 1).generate([prompt], [1])
    TestDriver(fp8, 64, 1).generate([prompt], [1])
    blocks = list(range(1, 1 + -(-len(prompt) // 4)))
    want = cast_saturated(exact.read_blocks(blocks)[0], torch.float8_e4m3fn)
    got = fp8.read_blocks(blocks)[0]
    slots = torch.arange(len(prompt))
    assert torch.equal(
        got.flatten(1, 2)[:, slots].view(torch.uint8), want.flatten(1, 2)[:, slots].view(torch.uint8)
    )


def test_outputs_do_not_depend_on_prefix_hits_or_chunking(tiny_qwen3: Path) -> None:
    prompts = _prompts()
    new_tokens = [9] * len(prompts)
    # One runner: the shared prefix is served from the cache, prompts are chunked (budget 8).
    driver = TestDriver(_runner(tiny_qwen3, "fp8"), max_num_batched_tokens=8, max_num_seqs=1)
    shared = [s.outputs for s in driver.generate(prompts, new_tokens)]
    assert driver.stats.prefix_hit_tokens > 0 and driver.stats.chunked_prefill_rows > 0
    # A fresh runner per prompt, each prefilled in one step.
    alone = [TestDriver(_runner(tiny_qwen3, "fp8"), 64, 1).generate([p], [9])[0].outputs for p in prompts]
    assert shared == alone
    exact = [s.outputs for s in TestDriver(_runner(tiny_qwen3, "auto"), 64, 5).generate(prompts, new_tokens)]
    # FP8 rounding of K and V moves logits a little: most greedy tokens stay.
    agree = sum(a == b for x, y in zip(shared, exact, strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= 0.8 * sum(new_tokens)


def test_calibrated_scales_double_for_fnuz() -> None:
    calibrated = torch.tensor([[0.5, 0.25], [2.0, 1.0]])
    fn = kv_cache_scales(2, calibrated, torch.float8_e4m3fn, torch.device("cpu"))
    fnuz = kv_cache_scales(2, calibrated, torch.float8_e4m3fnuz, torch.device("cpu"))
    assert fn is not None and fn.tolist() == [[0.5, 0.25], [2.0, 1.0]]
    assert fnuz is not None and fnuz.tolist() == [[1.0, 0.5], [4.0, 2.0]]
    assert kv_cache_scales(2, calibrated, torch.bfloat16, torch.device("cpu")) is None
    with pytest.raises(ValueError, match=r"KV-cache scales: expected \[3, 2\], got \(2, 2\)"):
        kv_cache_scales(3, calibrated, torch.float8_e4m3fn, torch.device("cpu"))
