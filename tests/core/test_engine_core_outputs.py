"""The engine core's per-step outputs over the real scheduler and a paged stand-in model: each
request's outputs add up to exactly its tokens (running rows take `_output`'s short path, the
first and the last output the full one), with the queue time once and the usage counters exact."""

from __future__ import annotations

from baton_engine.core.engine_core import EngineCore
from baton_engine.core.outputs import RequestOutput
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler import Scheduler
from baton_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tests.core.helpers import assert_no_leaks
from tests.core.paged_fake_model import PagedFakeModel, reference_next_token

VOCAB = 50
BLOCK = 4
NUM_BLOCKS = 64


class _Runner:
    def __init__(self) -> None:
        self.model = PagedFakeModel(NUM_BLOCKS, BLOCK, VOCAB)

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.model.run(step)


def _expected(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(reference_next_token(tokens, VOCAB))
    return tokens[len(prompt) :]


def test_outputs_add_up_to_each_requests_tokens_and_the_usage_counters() -> None:
    scheduler = Scheduler(
        num_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=12,
        max_model_len=64, enable_chunked_prefill=True, enable_prefix_caching=False, eos_token_id=None,
    )  # fmt: skip
    core = EngineCore(scheduler, _Runner())
    prompts = {"a": [3, 1, 4, 1, 5, 9, 2], "b": [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], "c": [1, 6]}
    lengths = {"a": 5, "b": 3, "c": 9}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, SamplingParams(max_tokens=lengths[rid], ignore_eos=True))
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}
    steps = 0
    while core.has_unfinished():
        for out in core.step():
            outputs[out.request_id].append(out)
        steps += 1
        assert steps < 100
    for rid, outs in outputs.items():
        assert [t for out in outs for t in out.new_token_ids] == _expected(prompts[rid], lengths[rid]), rid
        assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True], rid
        assert outs[-1].finish_reason == "length"
        assert [out.queue_time is not None for out in outs].count(True) == 1, rid
        assert all(out.num_prompt_tokens == len(prompts[rid]) for out in outs)
        assert all(out.new_logprobs is None and out.kv_transfer_params is None for out in outs)
        # No drafts: a request's step adds one token, and a step that adds none reports none.
        assert [len(out.new_token_ids) for out in outs] == [1] * lengths[rid], rid
    stats = core.stats()
    assert (stats.prompt_tokens, stats.generation_tokens) == (19, 17)
    assert core.num_requests == 0
    assert_no_leaks(scheduler)
