"""Structured output through the real engine (scheduler, CPU model runner, sampler) on a tiny
random-weight model with a real byte-level BPE tokenizer: whatever the weights say, every
constrained answer is valid under its schema, free requests beside them are untouched, drafts
the grammar refuses are never verified, a P/D decode leg continues the prefill leg's grammar,
and no grammar state or KV block outlives its request."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from baton_engine.core.engine_core import run_until_idle
from baton_engine.core.request import FinishReason, Request, RequestStatus
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler import Scheduler
from baton_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton_engine.entrypoints.llm import LLM
from baton_engine.structured.grammar import json_schema_grammar
from baton_engine.structured.manager import StructuredOutputManager
from baton_support.tiny_models import CHAT
from tests.core.scripted_connector import ScriptedConnector
from tests.structured.helpers import CallerExecutor, GatedExecutor
from tests.torch_threads import one_torch_thread

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "dev", "ops"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
FLAGS: dict[str, Any] = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 5}
POINT: dict[str, Any] = {
    "type": "object",
    "properties": {"x": {"type": "integer", "maximum": 999}, "y": {"type": "integer", "maximum": 999}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("structured-tiny") / "tiny-chat"
    CHAT.save(directory)
    return directory


def _llm(model_dir: Path, **settings: Any) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=128, max_model_len=512, **settings)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return _llm(model_dir)


def _params(schema: dict[str, Any], seed: int, **extra: Any) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=120, grammar=json_schema_grammar(schema), **extra
    )


def _assert_idle(llm: LLM) -> None:
    stats = llm.core.stats()
    assert (stats.num_grammar_requests, stats.num_used_kv_blocks, stats.num_running) == (0, 0, 0)


def test_constrained_answers_are_valid_and_free_requests_beside_them_are_untouched(llm: LLM) -> None:
    prompt = llm.tokenizer.encode("Hello world! How are you today?")
    free = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompt], free)[0].outputs[0].token_ids
    schemas = [PERSON, FLAGS, POINT]
    params = [_params(schema, seed) for seed, schema in enumerate(schemas)]
    params[0] = _params(PERSON, 0, n=3)  # three samples of one prompt, each with its own grammar
    outputs = llm.generate([prompt] * 4, [*params, free])
    for result, schema in zip(outputs, schemas, strict=False):
        for completion in result.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), schema)
    assert len({c.text for c in outputs[0].outputs}) > 1  # the n=3 samples differ
    # the free request's seeded samples do not depend on its neighbours' masks
    assert outputs[3].outputs[0].token_ids == alone
    _assert_idle(llm)


def test_greedy_and_seeded_answers_repeat_exactly(llm: LLM) -> None:
    prompt = llm.tokenizer.encode("def add(a, b):")
    for params in (
        SamplingParams(temperature=0.0, max_tokens=120, grammar=json_schema_grammar(POINT)),
        _params(PERSON, seed=5),
    ):
        first = llm.generate([prompt], params)[0].outputs[0]
        again = llm.generate([prompt, prompt], [params, params])
        assert [c.outputs[0].token_ids for c in again] == [first.token_ids] * 2


class _Drafts:
    """A drafter that proposes, for every decoding request, the next tokens of a known answer
    (all of which the grammar allows) followed by a token it refuses."""

    def __init__(self, answers: dict[int, list[int]], refused: int, k: int) -> None:
        self.answers = answers
        self.refused = refused
        self.k = k

    def propose(self, requests: Sequence[Request], max_model_len: int) -> dict[int, list[int]]:
        drafts = {}
        for request in requests:
            answer = self.answers[request.req_id]
            done = request.num_output_tokens
            drafts[request.req_id] = answer[done : done + self.k - 1] + [self.refused]
        return drafts


def test_drafts_the_grammar_refuses_are_never_verified(model_dir: Path, llm: LLM) -> None:
    prompt = llm.tokenizer.encode("Paris is the capital of France.")
    schemas = [PERSON, POINT]
    params = [_params(schema, seed=20 + i) for i, schema in enumerate(schemas)]
    reference = [r.outputs[0].token_ids for r in llm.generate([prompt, prompt], params)]

    k = 4
    spec = _llm(model_dir, speculative="ngram", num_speculative_tokens=k)
    first_req = spec.core._next_req_id
    refused = llm.tokenizer.token_to_id("<|im_start|>")  # a special token: no JSON grammar takes it
    assert refused is not None
    spec.core.drafter = _Drafts({first_req + i: ref for i, ref in enumerate(reference)}, refused, k)
    verified: list[list[int]] = []
    execute = spec.core.runner.execute

    def recording(step: SchedulerOutput) -> ModelRunnerOutput:
        for row in range(step.num_decode_rows):
            drafts = int(step.num_draft_tokens[row])
            if drafts:
                end = int(step.query_start_loc[row + 1])
                verified.append(step.input_ids[end - drafts : end].tolist())
                assert step.grammar_bitmask is not None and step.grammar_rows is not None
        return execute(step)

    spec.core.runner.execute = recording  # type: ignore[method-assign]
    outputs = spec.generate([prompt, prompt], params)
    # position-keyed seeded sampling under the same masks: speculation changes nothing
    assert [r.outputs[0].token_ids for r in outputs] == reference
    assert verified and all(refused not in drafts for drafts in verified)
    stats = spec.core.stats()
    assert stats.spec_accepted_tokens > 0
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens  # every verified draft was right
    _assert_idle(spec)


def test_a_bad_grammar_is_refused_at_the_boundary_and_in_the_core(llm: LLM) -> None:
    prompt = llm.tokenizer.encode("Hello")
    with pytest.raises(ValueError, match=r"^sampling_params\[1\]\.grammar: cannot be enforced"):
        llm.generate([prompt, prompt], [SamplingParams(), SamplingParams(grammar="start: (")])
    llm.core.add_request("bad", prompt, SamplingParams(grammar="start: ("))
    outputs: list[Any] = []
    run_until_idle(llm.core, outputs.extend)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad", "rejected")]
    assert outputs[0].finish_message.startswith("grammar: ")
    _assert_idle(llm)


def test_two_requests_sharing_a_grammar_that_fails_to_compile_are_both_refused(llm: LLM) -> None:
    prompt = llm.tokenizer.encode("Hello")
    core = llm.core
    core.add_request("bad-1", prompt, SamplingParams(grammar="start: ("))
    core.add_request("free", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    core.add_request("bad-2", prompt, SamplingParams(grammar="start: ("))
    outputs: list[Any] = []
    run_until_idle(core, outputs.extend)
    finished = {o.request_id: o for o in outputs if o.finished}
    assert {rid: o.finish_reason for rid, o in finished.items()} == {
        "bad-1": "rejected",
        "bad-2": "rejected",
        "free": "length",
    }
    assert finished["bad-1"].finish_message == finished["bad-2"].finish_message
    assert finished["bad-1"].finish_message.startswith("grammar: ")
    _assert_idle(llm)


def test_an_aborted_constrained_request_leaves_no_grammar_and_no_block(llm: LLM) -> None:
    prompt = llm.tokenizer.encode("The quick brown fox")
    core = llm.core
    params = SamplingParams(temperature=1.0, max_tokens=200, grammar=json_schema_grammar({"type": "string"}))
    core.add_request("long", prompt, params)
    core.add_request("short", prompt, _params(FLAGS, seed=1))
    core.step()
    core.step()
    assert core.stats().num_grammar_requests == 2
    core.abort_requests(["long"], "client gone")
    finished = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {"long": "abort", "short": "stop"}
    _assert_idle(llm)


def test_a_decode_leg_replays_the_prefill_legs_first_token(llm: LLM) -> None:
    """The consumer side of P/D at the scheduler: the first token the prefill leg sampled
    advances the grammar; a token the grammar refuses rejects the leg, naming the params."""
    tokenizer = llm.tokenizer
    vocab, eos = llm.info.vocab_size, tokenizer.eos_token_ids
    manager = StructuredOutputManager(tokenizer.backend.to_str, vocab, eos, compile_executor=CallerExecutor())
    connector = ScriptedConnector(block_size=4)
    scheduler = Scheduler(
        num_blocks=16, block_size=4, max_model_len=64, structured_output=manager, kv_connector=connector
    )
    prompt = tokenizer.encode("Hello world")
    brace, bracket = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("{", "["))
    legs = {}
    for req_id in (0, 1):
        request = Request(req_id, prompt, SamplingParams(grammar=json_schema_grammar(POINT)))
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        scheduler.add(request)
        legs[req_id] = request
    scheduler.schedule()  # reserves both legs' blocks
    assert list(connector.reserved) == [0, 1]
    connector.arrive(0, len(prompt), first_token_id=brace)
    connector.arrive(1, len(prompt), first_token_id=bracket)
    scheduler.update_from_kv_connector()
    assert legs[1].finish_reason is FinishReason.REJECTED
    assert legs[1].finish_message == (
        f"kv_transfer_params: the prefill leg's first token {bracket} is refused by the request's grammar "
        "(not allowed here) (did both legs get the same response_format and tools?)"
    )
    assert 1 not in manager and scheduler.kv_cache_manager.num_blocks_of(1) == 0
    out = scheduler.schedule()  # leg 0 recomputes its last token and samples the second one
    assert out.req_ids == [0] and out.grammar_bitmask is not None
    second = out.grammar_bitmask[0]
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    assert (int(second[quote // 32]) >> (quote % 32)) & 1  # after "{" a key's quote
    assert not (int(second[brace // 32]) >> (brace % 32)) & 1


@contextmanager
def _compiles_held(llm: LLM) -> Iterator[tuple[StructuredOutputManager, GatedExecutor]]:
    """`llm`'s engine with a manager whose compiles wait until the test releases them."""
    tokenizer = llm.tokenizer
    gate = GatedExecutor()
    manager = StructuredOutputManager(
        tokenizer.backend.to_str, llm.info.vocab_size, tokenizer.eos_token_ids, compile_executor=gate
    )
    scheduler = llm.core.scheduler
    previous, scheduler.structured_output = scheduler.structured_output, manager
    try:
        yield manager, gate
    finally:
        scheduler.structured_output = previous


def test_running_streams_keep_decoding_while_a_new_schema_compiles(llm: LLM) -> None:
    prompt = llm.tokenizer.encode("Hello world! How are you today?")
    free = SamplingParams(temperature=1.0, seed=4, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt], free)[0].outputs[0].token_ids
    core = llm.core
    with _compiles_held(llm) as (manager, gate):
        tokens: dict[str, list[int]] = {"free": [], "json": []}
        core.add_request("free", prompt, free)
        (first,) = core.step()  # its prefill and first token
        tokens["free"] += first.new_token_ids
        core.add_request("json", prompt, _params(PERSON, seed=5))
        for _ in range(6):  # the compile has not ended: the running stream is not held up
            (out,) = core.step()
            assert (out.request_id, len(out.new_token_ids)) == ("free", 1)
            tokens["free"] += out.new_token_ids
        stats = core.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_grammar_requests) == (1, 1, 1)
        assert (gate.num_held, manager.num_compiling, manager.num_compiled) == (1, 1, 0)
        gate.release()  # the compile ends; the next step admits the request
        reasons: dict[str, str | None] = {}
        while core.has_unfinished():
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        assert reasons == {"free": "length", "json": "stop"}
        assert tokens["free"] == alone  # seeded: its masks-free samples did not depend on the wait
        jsonschema.validate(json.loads(llm.tokenizer.decode(tokens["json"])), PERSON)
        assert (len(manager), manager.num_compiling, manager.num_compiled) == (0, 0, 1)
    _assert_idle(llm)


def test_an_abort_while_the_schema_compiles_frees_everything(llm: LLM) -> None:
    prompt = llm.tokenizer.encode("The quick brown fox")
    core = llm.core
    with _compiles_held(llm) as (manager, gate):
        core.add_request("json", prompt, _params(POINT, seed=6))
        assert core.step() == []  # nothing to run: the request waits for its grammar
        assert (core.stats().num_waiting, len(manager)) == (1, 1)
        core.abort_requests(["json"], "client gone")
        (out,) = core.step()
        assert (out.request_id, out.finish_reason, out.new_token_ids) == ("json", "abort", [])
        assert not core.has_unfinished() and (len(manager), manager.num_compiling) == (0, 0)
        gate.release()  # the compile still ends: kept to copy from, owned by nobody
        assert core.step() == []
        assert (len(manager), manager.num_compiling, manager.num_compiles) == (0, 0, 0)
        assert manager.num_compiled == 1
    _assert_idle(llm)
