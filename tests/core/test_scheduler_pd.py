"""The P/D consumer path of the scheduler, with a scripted KV connector and a model that reads its
context back through the paged KV cache (a consumer's KV is "pulled" by writing the prompt's
tokens into its reserved blocks, as a real pull writes the producer's KV there).

Bugs fixed here (issue 15), each pinned by a test: reservations beyond max_num_seqs, arrived
consumers that could never get a block (deadlock), consumers served last-in first-out, and a
consumer whose prompt fills the pool holding it forever.
"""

from __future__ import annotations

import numpy as np
import pytest

from baton_engine.core.request import FinishReason, Request, RequestStatus
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler import Scheduler
from tests.core.helpers import assert_no_leaks, drive
from tests.core.paged_fake_model import PagedFakeModel, reference_next_token
from tests.core.scripted_connector import ScriptedConnector

BS = 4
VOCAB = 50
EOS = 0


def make(connector: ScriptedConnector, **overrides: object) -> Scheduler:
    settings: dict[str, object] = dict(
        num_blocks=16,
        block_size=BS,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        eos_token_id=EOS,
        kv_connector=connector,
    )
    settings.update(overrides)
    return Scheduler(**settings)  # type: ignore[arg-type]


def params(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def consumer(req_id: int, prompt: list[int], max_tokens: int = 4) -> Request:
    request = Request(req_id, prompt, params(max_tokens))
    request.status = RequestStatus.WAITING_FOR_REMOTE_KV
    return request


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(reference_next_token(tokens, VOCAB))
    return tokens[len(prompt) :]


def pull(
    model: PagedFakeModel, connector: ScriptedConnector, request: Request, first_token: bool = True
) -> None:
    """What a real pull does: the prompt's KV into the reserved blocks, then the arrival (with the
    producer's first token, as a producer samples it)."""
    prompt = request.token_ids[: request.num_prompt_tokens]
    positions = np.arange(len(prompt))
    blocks = np.asarray(connector.reserved[request.req_id])
    slots = blocks[positions // BS] * BS + positions % BS
    model.kv_tokens[slots] = prompt
    model.kv_positions[slots] = positions
    first = reference_next_token(prompt, VOCAB) if first_token else None
    connector.arrive(request.req_id, len(prompt), first_token_id=first)


def test_reservations_stop_at_max_num_seqs() -> None:
    """max_num_seqs=2, one running, five consumers: one schedule reserves blocks for one of them
    (running + parked <= max_num_seqs), the next ones as rows come free, in arrival order."""
    connector = ScriptedConnector(BS)
    s = make(connector, max_num_seqs=2)
    model = PagedFakeModel(16, BS, VOCAB)
    local = Request(100, [5, 6, 7], params(max_tokens=3))
    s.add(local)
    out = s.schedule()
    s.postprocess(out, model.run(out))
    consumers = [consumer(i, [10 + i, 20 + i, 30 + i]) for i in range(5)]
    for request in consumers:
        s.add(request)
    out = s.schedule()
    assert out.req_ids == [100]
    assert list(connector.reserved) == [0]  # 1 running + 1 parked = max_num_seqs
    assert s.kv_cache_manager.num_used_blocks == 2
    s.postprocess(out, model.run(out))

    def before_step(_: int) -> None:
        assert s.num_running + s.num_parked <= 2
        for request in consumers:
            if request.req_id in connector.pulling:
                pull(model, connector, request)

    drive(s, model, before_step=before_step)
    assert list(connector.reserved) == [0, 1, 2, 3, 4]  # in arrival order
    assert local.output_token_ids == reference([5, 6, 7], 3)
    for request in consumers:
        assert request.output_token_ids == reference(request.token_ids[:3], 4), request
        assert request.finish_reason is FinishReason.LENGTH
    assert_no_leaks(s)


def test_arrived_consumers_that_fill_the_pool_make_progress() -> None:
    """Pool of 4 blocks of 4, two 8-token consumers: both reserved (the whole pool), both arrive;
    each needs one more block for the producer's first token. One is preempted by recompute (as a
    local request would be) so the other runs; both finish with the reference tokens."""
    connector = ScriptedConnector(BS)
    s = make(connector, num_blocks=4)
    model = PagedFakeModel(4, BS, VOCAB)
    a, b = consumer(1, list(range(1, 9)), 3), consumer(2, list(range(11, 19)), 3)
    s.add(a)
    s.add(b)
    assert s.schedule().num_rows == 0
    assert connector.reserved == {1: [0, 1], 2: [2, 3]} and s.kv_cache_manager.num_free_blocks == 0
    pull(model, connector, a)
    pull(model, connector, b)
    drive(s, model, max_steps=100)
    assert a.output_token_ids == reference(list(range(1, 9)), 3)
    assert b.output_token_ids == reference(list(range(11, 19)), 3)
    assert s.num_preemptions >= 1
    assert_no_leaks(s)


def test_a_preempted_local_request_returns_behind_arrived_consumers() -> None:
    """A local request decoding in a small pool is preempted while consumers arrive holding blocks;
    it must come back and finish (not wait behind parked consumers forever)."""
    connector = ScriptedConnector(BS)
    s = make(connector, num_blocks=6, max_num_seqs=3)
    model = PagedFakeModel(6, BS, VOCAB)
    local = Request(100, [5, 6, 7, 8], params(max_tokens=9))
    s.add(local)
    out = s.schedule()
    s.postprocess(out, model.run(out))
    consumers = [consumer(1, list(range(1, 9)), 2), consumer(2, list(range(11, 18)), 2)]
    for request in consumers:
        s.add(request)
    drive(
        s,
        model,
        max_steps=200,
        before_step=lambda _: [pull(model, connector, r) for r in consumers if r.req_id in connector.pulling],
    )
    assert local.output_token_ids == reference([5, 6, 7, 8], 9)
    for request in consumers:
        assert request.output_token_ids == reference(request.token_ids[: request.num_prompt_tokens], 2)
    assert_no_leaks(s)


def test_a_consumer_whose_prompt_fills_the_pool_is_finished_with_a_reason() -> None:
    """A 16-token prompt in a pool of 16 tokens: the KV arrives, and with the producer's first token
    the request can never fit. A local request there stops with ``length`` after its first token
    ("cannot resume after preemption: ..."); the consumer stops the same way, saying so, instead
    of holding every block forever."""
    connector = ScriptedConnector(BS)
    s = make(connector, num_blocks=4)
    model = PagedFakeModel(4, BS, VOCAB)
    request = consumer(1, list(range(1, 17)), 4)
    s.add(request)
    assert s.schedule().num_rows == 0
    assert connector.reserved == {1: [0, 1, 2, 3]}
    pull(model, connector, request)
    results = drive(s, model, max_steps=20)
    assert request.finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == reference(list(range(1, 17)), 1)
    assert request.finish_message == (
        "cannot run after its KV arrived: prompt + output needs 5 KV blocks, more than the whole pool "
        "(4 blocks of 4 tokens)"
    )
    assert [r for step in results for r in step.finished] == [request]
    assert_no_leaks(s)

    # The same prompt as a local request ends exactly so.
    local_s = make(ScriptedConnector(BS), num_blocks=4)
    local = Request(2, list(range(1, 17)), params(4))
    local_s.add(local)
    drive(local_s, PagedFakeModel(4, BS, VOCAB), max_steps=20)
    assert local.finish_reason is request.finish_reason
    assert local.output_token_ids == request.output_token_ids
    assert local.finish_message == (
        "cannot resume after preemption: prompt + output needs 5 KV blocks, more than the whole pool "
        "(4 blocks of 4 tokens)"
    )


@pytest.mark.parametrize("same_update", [True, False])
def test_arrived_consumers_are_served_in_arrival_order(same_update: bool) -> None:
    connector = ScriptedConnector(BS)
    s = make(connector, max_num_seqs=4)
    model = PagedFakeModel(16, BS, VOCAB)
    consumers = [consumer(i, [10 + i, 20 + i, 30 + i, 40 + i, 50 + i], 2) for i in (7, 3, 5)]
    for request in consumers:
        s.add(request)
    assert s.schedule().num_rows == 0
    assert list(connector.reserved) == [7, 3, 5]  # reserved in arrival (add) order
    order = [3, 5, 7]  # the pulls end in another order
    if same_update:
        for req_id in order:
            pull(model, connector, next(r for r in consumers if r.req_id == req_id))
    else:
        for req_id in order:
            pull(model, connector, next(r for r in consumers if r.req_id == req_id))
            s.update_from_kv_connector()
    out = s.schedule()
    assert out.req_ids == order  # served first come, first served (was last in, first out)
    s.postprocess(out, model.run(out))
    drive(s, model)
    assert_no_leaks(s)
