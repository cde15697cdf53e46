"""The n-gram drafter inside the real engine core and scheduler, over a model that reads its
context back through the paged KV cache: speculation must not change a single token under
preemption, prefix caching and chunked prefill, and every KV block comes back."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from baton_engine.core.engine_core import EngineCore, run_until_idle
from baton_engine.core.outputs import RequestOutput
from baton_engine.core.request import Request, RequestStatus
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler import Scheduler
from baton_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton_engine.spec_decode.drafter import NgramDrafter
from baton_engine.spec_decode.ngram_proposer import NgramProposer
from tests.core.helpers import assert_no_leaks, check_step_invariants
from tests.core.paged_fake_model import PagedFakeModel, reference_next_token
from tests.core.scripted_connector import ScriptedConnector

VOCAB = 3  # tiny: n-grams recur all the time, and drafts are right about half the time
EOS = 0
BLOCK = 4
MAX_MODEL_LEN = 48


class CheckedRunner:
    """The paged fake model, checking each step's invariants and counting query tokens."""

    def __init__(self, scheduler: Scheduler, num_blocks: int) -> None:
        self.scheduler = scheduler
        self.model = PagedFakeModel(num_blocks, BLOCK, VOCAB)
        self.max_query_tokens = 0
        self.speculative_steps = 0
        self._decoding: set[int] = set()

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        check_step_invariants(self.scheduler, step, self._decoding)
        self.max_query_tokens = max(self.max_query_tokens, step.num_tokens)
        self.speculative_steps += bool(step.num_draft_tokens.any())
        result = self.model.run(step)
        batch = self.scheduler.batch
        self._decoding = set(batch.req_ids[: batch.num_decode])
        return result


class CheckingDrafter(NgramDrafter):
    """Before each step: no decoding request holds a block beyond what its tokens need (the
    previous step's rejected slots were rolled back; the next token's block may still be missing,
    it is taken at schedule time), and the pool counts exactly the blocks live requests hold."""

    def __init__(self, proposer: NgramProposer, scheduler: Scheduler) -> None:
        super().__init__(proposer)
        self.scheduler = scheduler

    def propose(self, requests: Sequence[Request], max_model_len: int) -> dict[int, list[int]]:
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        for request in requests:
            needed = -(-request.num_tokens // BLOCK)
            assert needed - 1 <= kv.num_blocks_of(request.req_id) <= needed, request
        live = [*scheduler.batch.requests, *scheduler.waiting]
        held = {b for request in live for b in kv.block_ids(request.req_id)}
        assert kv.num_used_blocks == len(held)
        return super().propose(requests, max_model_len)


def reference(prompt: list[int], params: SamplingParams) -> list[int]:
    tokens = list(prompt)
    while True:
        token = reference_next_token(tokens, VOCAB)
        tokens.append(token)
        n_out = len(tokens) - len(prompt)
        if (token == EOS and not params.ignore_eos) or token in params.stop_token_ids:
            break
        if n_out >= params.max_tokens or len(tokens) >= MAX_MODEL_LEN:
            break
    return tokens[len(prompt) :]


def workload(seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(9)]
    requests = []
    for i in range(12):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 14))]
        params = SamplingParams(
            max_tokens=rng.randrange(1, 30),
            ignore_eos=i % 2 == 0,
            stop_token_ids=(2,) if i % 5 == 0 else (),
        )
        requests.append((prompt, params))
    return requests


CONFIGS = {
    "roomy, prefix cache, chunked": dict(num_blocks=200, budget=24, chunked=True, prefix_caching=True),
    "tiny pool (preemption)": dict(num_blocks=14, budget=24, chunked=True, prefix_caching=True),
    "small budget": dict(num_blocks=200, budget=8, chunked=True, prefix_caching=True),
    "no prefix cache, no chunking": dict(num_blocks=200, budget=64, chunked=False, prefix_caching=False),
}


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_speculation_never_changes_tokens_and_frees_every_block(config_name: str, k: int) -> None:
    config = CONFIGS[config_name]
    scheduler = Scheduler(
        num_blocks=config["num_blocks"],
        block_size=BLOCK,
        max_num_seqs=6,
        max_num_batched_tokens=config["budget"],
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=config["chunked"],
        enable_prefix_caching=config["prefix_caching"],
        eos_token_id=EOS,
        num_speculative_tokens=k,
    )
    runner = CheckedRunner(scheduler, config["num_blocks"])
    core = EngineCore(scheduler, runner, drafter=CheckingDrafter(NgramProposer(k, 1, 3), scheduler))
    requests = workload(seed=k)
    for i, (prompt, params) in enumerate(requests):
        core.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    reasons: dict[str, str | None] = {}

    def collect(batch: list[RequestOutput]) -> None:
        for out in batch:
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason

    run_until_idle(core, collect)
    for i, (prompt, params) in enumerate(requests):
        assert outputs[f"r{i}"] == reference(prompt, params), (config_name, i)
        assert reasons[f"r{i}"] in ("stop", "length")
    stats = scheduler.spec_stats
    assert runner.speculative_steps > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert runner.max_query_tokens <= config["budget"]
    if config_name.startswith("tiny pool"):
        assert scheduler.num_preemptions > 0
    assert_no_leaks(scheduler)


def test_drafts_never_exceed_what_the_request_may_still_get() -> None:
    drafter = NgramDrafter(NgramProposer(4, 1, 2))
    tokens = [1, 2, 1, 2, 1, 2, 1]
    cases = [
        # (max_tokens, output so far, max_model_len) -> drafts
        (20, 0, 100, [2, 1, 2, 1]),
        (3, 0, 100, [2, 1]),  # 3 tokens left: 2 drafts + the bonus token
        (20, 2, 9, [2]),  # 9 - 7 = 2 positions left before max_model_len
        (20, 0, 8, []),  # 1 position left: nothing to draft
        (1, 0, 100, []),
    ]
    for max_tokens, produced, max_model_len, expected in cases:
        request = Request(1, tokens[: len(tokens) - produced], SamplingParams(max_tokens=max_tokens))
        request.token_ids[:] = tokens
        drafts = drafter.propose([request], max_model_len)
        assert drafts.get(1, []) == expected, (max_tokens, produced, max_model_len)
        assert 1 not in drafts or drafts[1], "empty drafts are left out"


def test_token_buffers_follow_the_decoding_sequences() -> None:
    drafter = NgramDrafter(NgramProposer(2, 1, 2))
    a = Request(1, [1, 2, 1], SamplingParams(max_tokens=9))
    b = Request(2, [3, 3], SamplingParams(max_tokens=9))
    assert drafter.propose([a, b], 100) == {1: [2, 1], 2: [3, 3]}
    a.token_ids.append(5)
    assert drafter.propose([a], 100) == {}  # b finished or was preempted: its buffer goes
    assert sorted(drafter._buffers) == [1]
    a.token_ids.extend([1, 2])
    assert drafter.propose([a], 100) == {1: [1, 5]}


def test_a_pd_consumer_speculates_on_pulled_kv() -> None:
    """Decode pod: the prompt's KV arrives from a producer (written straight into the cache here),
    the producer's first token comes with it, and the consumer then decodes with drafts."""
    k, num_blocks = 4, 64
    connector = ScriptedConnector(BLOCK)
    scheduler = Scheduler(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=MAX_MODEL_LEN,
        eos_token_id=EOS,
        num_speculative_tokens=k,
        kv_connector=connector,
    )
    runner = CheckedRunner(scheduler, num_blocks)
    core = EngineCore(scheduler, runner, drafter=NgramDrafter(NgramProposer(k, 1, 3)))
    prompt = [1, 2, 1, 1, 2, 2, 1, 2, 1, 1, 2]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    seq = Request(0, prompt, params)
    seq.status = RequestStatus.WAITING_FOR_REMOTE_KV
    scheduler.add(seq)
    assert scheduler.schedule().num_rows == 0  # reserves the blocks
    assert list(connector.reserved) == [0]
    positions = np.arange(len(prompt))
    slots = np.asarray(connector.reserved[0])[positions // BLOCK] * BLOCK + positions % BLOCK
    runner.model.kv_tokens[slots] = prompt
    runner.model.kv_positions[slots] = positions
    first = reference_next_token(prompt, VOCAB)
    connector.arrive(0, len(prompt), first_token_id=first)
    while scheduler.has_unfinished():
        core.step()
    assert seq.output_token_ids == reference(prompt, params)
    assert scheduler.spec_stats.num_accepted_tokens > 0
    assert_no_leaks(scheduler)
