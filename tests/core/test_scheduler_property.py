"""Property test: random workloads through the scheduler and a model that really reads the paged
KV cache (`PagedFakeModel`). Every request's tokens must equal the reference stream computed
straight from its token list, whatever the KV pressure (preemption), prefix caching, chunked
prefill or speculative decoding; budgets hold every step; nothing leaks."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton_engine.core.request import FinishReason, Request, RequestStatus
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler import Scheduler
from baton_engine.prefix.events import BlocksStored
from baton_engine.prefix.hashing import BlockHash, PrefixHasher, fast_prefix_hash
from tests.core.helpers import assert_no_leaks, check_step_invariants
from tests.core.paged_fake_model import PagedFakeModel, reference_next_token

VOCAB = 24
EOS = 0
MAX_MODEL_LEN = 48


@dataclass(frozen=True)
class Workload:
    prompt: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]
    arrival_step: int
    abort_step: int | None


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, list[Workload]]:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    prefixes = [tuple(draw(st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=24))) for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        prefix = prefixes[draw(st.integers(0, 1))]
        suffix = tuple(draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=16)))
        stop_ids = tuple(draw(st.lists(st.integers(1, VOCAB - 1), max_size=1)))
        requests.append(
            Workload(
                prompt=prefix + suffix,
                max_tokens=draw(st.integers(1, 20)),
                ignore_eos=draw(st.booleans()),
                stop_token_ids=stop_ids,
                arrival_step=draw(st.integers(0, 5)),
                abort_step=draw(st.one_of(st.none(), st.none(), st.integers(0, 25))),
            )
        )
    return block_size, requests


def weak_hash(parent: BlockHash | None, token_ids: tuple[int, ...]) -> int:
    """Ignores the parent and collides constantly: hits must still be exact."""
    return sum(token_ids) % 5


def reference_output(request: Workload) -> list[int]:
    tokens = list(request.prompt)
    output: list[int] = []
    while True:
        token = reference_next_token(tokens, VOCAB)
        tokens.append(token)
        output.append(token)
        if (token == EOS and not request.ignore_eos) or token in request.stop_token_ids:
            return output
        if len(output) >= request.max_tokens or len(tokens) >= MAX_MODEL_LEN:
            return output


def check_events(scheduler: Scheduler) -> None:
    for event in scheduler.kv_cache_manager.take_events():
        if isinstance(event, BlocksStored):
            parent = event.parent_block_hash
            bs = event.block_size
            for i, expected in enumerate(event.block_hashes):
                parent = fast_prefix_hash(parent, event.token_ids[i * bs : (i + 1) * bs])
                assert parent == expected


def run_workload(
    block_size: int,
    requests: list[Workload],
    *,
    num_blocks: int,
    budget: int,
    chunked: bool,
    prefix_caching: bool,
    speculative: int = 0,
    hasher: PrefixHasher = fast_prefix_hash,
) -> dict[int, Request]:
    scheduler = Scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix_caching,
        eos_token_id=EOS,
        num_speculative_tokens=speculative,
        prefix_hasher=hasher,
    )
    model = PagedFakeModel(num_blocks, block_size, VOCAB)
    drafter = random.Random(7)
    seqs: dict[int, Request] = {}
    decoding: set[int] = set()
    for step in range(2000):
        for i, request in enumerate(requests):
            if request.arrival_step == step:
                params = SamplingParams(
                    max_tokens=request.max_tokens,
                    ignore_eos=request.ignore_eos,
                    stop_token_ids=request.stop_token_ids,
                )
                seqs[i] = Request(i, list(request.prompt), params)
                scheduler.add(seqs[i])
            if request.abort_step == step and i in seqs:
                scheduler.abort(i)
        drafts: dict[int, list[int]] = {}
        if speculative:
            for decoding_request in scheduler.decoding_requests():
                proposed, tokens = [], list(decoding_request.token_ids)
                for _ in range(speculative):
                    token = reference_next_token(tokens, VOCAB)
                    if drafter.random() < 0.3:
                        token = (token + 1) % VOCAB
                    proposed.append(token)
                    tokens.append(token)
                drafts[decoding_request.req_id] = proposed
        if step > max(r.arrival_step for r in requests) and not scheduler.has_unfinished():
            break
        out = scheduler.schedule(drafts)
        if out.num_rows:
            check_step_invariants(scheduler, out, decoding)
            if not speculative:
                # Mixed batches: every decoding request is in the step with exactly one token.
                assert (out.query_lens[: out.num_decode_rows] == 1).all()
            scheduler.postprocess(out, model.run(out))
            decoding = set(scheduler.batch.req_ids[: scheduler.batch.num_decode])
        else:
            scheduler.take_finished()
        if hasher is fast_prefix_hash:
            check_events(scheduler)
        else:
            scheduler.kv_cache_manager.take_events()
        assert 0.0 <= scheduler.kv_cache_manager.usage() <= 1.0
    else:
        raise AssertionError("workload did not drain")
    assert_no_leaks(scheduler)
    return seqs


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
def test_token_streams_do_not_depend_on_cache_pressure_or_batching(
    workload: tuple[int, list[Workload]],
) -> None:
    block_size, requests = workload
    min_pool = -(-MAX_MODEL_LEN // block_size) + 1  # one sequence alone always fits
    configs = {
        "roomy, prefix cache, chunked": dict(
            num_blocks=8 * min_pool, budget=12, chunked=True, prefix_caching=True
        ),
        "tiny pool (preemption)": dict(num_blocks=min_pool, budget=16, chunked=True, prefix_caching=True),
        "no prefix cache, no chunking": dict(
            num_blocks=8 * min_pool, budget=MAX_MODEL_LEN, chunked=False, prefix_caching=False
        ),
        "weak colliding hasher, tiny pool": dict(
            num_blocks=min_pool, budget=12, chunked=True, prefix_caching=True, hasher=weak_hash
        ),
        "speculative, tiny pool": dict(
            num_blocks=min_pool + 2, budget=16, chunked=True, prefix_caching=True, speculative=2
        ),
    }
    for name, config in configs.items():
        seqs = run_workload(block_size, requests, **config)  # type: ignore[arg-type]
        for i, request in enumerate(requests):
            seq = seqs[i]
            assert seq.status is RequestStatus.FINISHED, name
            expected = reference_output(request)
            if seq.finish_reason is FinishReason.ABORT:
                assert expected[: seq.num_output_tokens] == seq.output_token_ids, name
            else:
                assert seq.output_token_ids == expected, (name, i)
