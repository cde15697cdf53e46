"""Random interleavings of local and P/D-consumer requests on small pools: arrivals at random
steps, pulls that end after random delays (KV arrived with or without the producer's first token,
failed and recomputed, failed for good), aborts at any time (during a pull too). Every request
finishes or is rejected with a reason, with exactly the tokens a lone request would get (a prefix
of them when aborted), no block leaks, and arrived consumers are served in arrival order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton_engine.core.request import FinishReason, Request, RequestStatus
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler import Scheduler
from tests.core.helpers import assert_no_leaks, check_step_invariants
from tests.core.paged_fake_model import PagedFakeModel, reference_next_token
from tests.core.scripted_connector import ScriptedConnector

BS = 4
VOCAB = 13
EOS = 0
MAX_MODEL_LEN = 48
PULL_OUTCOMES = ("with_first_token", "without_first_token", "fail_recompute", "fail")


@dataclass(frozen=True)
class Plan:
    """One request of a workload."""

    prompt: tuple[int, ...]
    max_tokens: int
    arrival_step: int
    remote: bool
    pull_delay: int
    """Steps between the reservation and the end of the pull (remote only)."""
    pull_outcome: str
    abort_step: int | None


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict[str, int], list[Plan]]:
    config = {
        "num_blocks": draw(st.integers(3, 20)),
        "max_num_seqs": draw(st.integers(1, 4)),
        "budget": draw(st.integers(4, 24)),
        "chunked": draw(st.booleans()),
    }
    config["budget"] = max(config["budget"], config["max_num_seqs"])
    shared = tuple(draw(st.lists(st.integers(1, VOCAB - 1), max_size=8)))
    plans = []
    if draw(st.booleans()):
        # A burst of consumers whose prompts fill whole blocks, pulled at once: with the producer's
        # first token each needs one block more than it reserved (the tight case).
        config["num_blocks"] = draw(st.integers(3, 9))
        for _ in range(draw(st.integers(2, 4))):
            blocks = draw(st.integers(1, 2))
            plans.append(
                Plan(
                    prompt=tuple(
                        draw(st.lists(st.integers(1, VOCAB - 1), min_size=BS * blocks, max_size=BS * blocks))
                    ),
                    max_tokens=draw(st.integers(1, 6)),
                    arrival_step=draw(st.integers(0, 1)),
                    remote=True,
                    pull_delay=draw(st.integers(0, 1)),
                    pull_outcome=draw(st.sampled_from(PULL_OUTCOMES[:2])),
                    abort_step=draw(st.none() | st.integers(0, 25)),
                )
            )
    for _ in range(draw(st.integers(0 if plans else 1, 5))):
        tail = tuple(draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=14)))
        prompt = (shared if draw(st.booleans()) else ()) + tail
        plans.append(
            Plan(
                prompt=prompt,
                max_tokens=draw(st.integers(1, 6)),
                arrival_step=draw(st.integers(0, 8)),
                remote=draw(st.booleans()),
                pull_delay=draw(st.integers(0, 4)),
                pull_outcome=draw(st.sampled_from(PULL_OUTCOMES)),
                abort_step=draw(st.none() | st.integers(0, 25)),
            )
        )
    return config, plans


def reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens and len(tokens) < MAX_MODEL_LEN:
        token = reference_next_token(tokens, VOCAB)
        tokens.append(token)
        out.append(token)
    return out


def run(config: dict[str, int], plans: list[Plan]) -> None:
    connector = ScriptedConnector(BS)
    scheduler = Scheduler(
        num_blocks=config["num_blocks"],
        block_size=BS,
        max_num_seqs=config["max_num_seqs"],
        max_num_batched_tokens=config["budget"],
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=bool(config["chunked"]),
        eos_token_id=EOS,
        kv_connector=connector,
    )
    model = PagedFakeModel(config["num_blocks"], BS, VOCAB)
    requests: dict[int, Request] = {}
    reserved_at: dict[int, int] = {}
    arrived_order: list[int] = []  # consumers whose KV arrived, in arrival order
    first_row: dict[int, tuple[int, int]] = {}  # request -> (step, row) of its first scheduled row
    decoding: set[int] = set()
    last_arrival = max(p.arrival_step for p in plans)
    for step in range(600):
        for i, plan in enumerate(plans):
            if plan.arrival_step == step:
                request = Request(
                    i, list(plan.prompt), SamplingParams(max_tokens=plan.max_tokens, ignore_eos=True)
                )
                if plan.remote:
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KV
                requests[i] = request
                scheduler.add(request)
            if plan.abort_step == step and i in requests:
                scheduler.abort(i)
        for req_id in list(connector.aborted_pulls):  # the pull thread notices the cancel
            connector.aborted_pulls.remove(req_id)
            connector.stop_pull(req_id)
        for req_id, blocks in connector.reserved.items():
            reserved_at.setdefault(req_id, step)
            plan = plans[req_id]
            if req_id not in connector.pulling or step - reserved_at[req_id] < plan.pull_delay:
                continue
            if plan.pull_outcome.startswith("fail"):
                connector.fail(
                    req_id, "producer_unreachable", recompute=plan.pull_outcome == "fail_recompute"
                )
                continue
            prompt = np.asarray(plan.prompt)
            positions = np.arange(len(prompt))
            slots = np.asarray(blocks)[positions // BS] * BS + positions % BS
            model.kv_tokens[slots] = prompt
            model.kv_positions[slots] = positions
            with_first = plan.pull_outcome == "with_first_token"
            connector.arrive(
                req_id, len(prompt), reference_next_token(list(prompt), VOCAB) if with_first else None
            )
            arrived_order.append(req_id)
        if step > last_arrival and not scheduler.has_unfinished() and not connector.pulling:
            break
        out = scheduler.schedule()
        assert scheduler.num_running + scheduler.num_parked <= config["max_num_seqs"]
        for row, req_id in enumerate(out.req_ids):
            first_row.setdefault(req_id, (step, row))
        if out.num_rows:
            check_step_invariants(scheduler, out, decoding)
            scheduler.postprocess(out, model.run(out))
        else:
            scheduler.take_finished()
        decoding = set(scheduler.batch.req_ids[: scheduler.batch.num_decode])
        scheduler.kv_cache_manager.take_events()
    else:
        raise AssertionError("workload did not drain in 600 steps")
    assert_no_leaks(scheduler)

    for i, request in requests.items():
        plan = plans[i]
        assert request.is_finished, request
        want = reference(plan.prompt, plan.max_tokens)
        got = request.output_token_ids
        if request.finish_reason is FinishReason.REJECTED:
            assert request.finish_message and got == [], request
        elif request.finish_reason is FinishReason.ABORT:
            assert got == want[: len(got)], (i, got, want)
            failed_for_good = plan.remote and plan.pull_outcome == "fail"
            assert plan.abort_step is not None or failed_for_good, (i, request.finish_message)
        elif request.finish_message and request.finish_message.startswith("cannot "):
            assert got == want[: len(got)] and len(got) >= 1, (
                i,
                request.finish_message,
            )  # the pool is too small
        else:
            assert request.finish_reason is FinishReason.LENGTH and got == want, (i, got, want)

    # First come, first served among arrived consumers that nothing preempted or aborted.
    served = [
        i
        for i in arrived_order
        if requests[i].num_preemptions == 0 and i in first_row and plans[i].abort_step is None
    ]
    assert sorted(served, key=lambda i: first_row[i]) == served, (served, first_row)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
@given(workloads())
def test_random_local_and_remote_interleavings(workload: tuple[dict[str, int], list[Plan]]) -> None:
    run(*workload)
