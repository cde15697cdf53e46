"""Run the offline `LLM` with speculation on or off and record what each step produced."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from baton_engine.core.engine_stats import EngineStats
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton_engine.entrypoints.llm import LLM, GenerationOutput, Prompt


@dataclass
class Run:
    outputs: list[GenerationOutput]
    stats: EngineStats
    steps: dict[int, list[list[int]]] = field(default_factory=dict)
    """Per request (in prompt order): the tokens the runner returned for it in each step that
    sampled it — several per step when drafts were accepted — before any stop truncation."""

    def token_ids(self) -> list[list[int]]:
        return [out.outputs[0].token_ids for out in self.outputs]

    def finish_reasons(self) -> list[str | None]:
        return [out.outputs[0].finish_reason for out in self.outputs]

    def generated(self, request: int) -> int:
        """Tokens the engine generated for `request` (before cutting at a stop string)."""
        return sum(len(tokens) for tokens in self.steps.get(request, []))


def make_llm(model: str, *, k: int = 0, ngram_max: int = 3, **settings: Any) -> LLM:
    if k:
        settings.update(speculative="ngram", num_speculative_tokens=k, ngram_min=1, ngram_max=ngram_max)
    settings.setdefault("num_kv_blocks", 512)
    settings.setdefault("dtype", "float64")
    return LLM(model, **settings)


def generate(llm: LLM, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams]) -> Run:
    """`llm.generate`, recording each step's sampled tokens per request (requests get sequence
    ids in prompt order, counted from the LLM's first request)."""
    runner = llm.core.runner
    first_req_id = llm.core._next_req_id
    steps: dict[int, list[list[int]]] = {}
    execute = runner.execute

    def recording_execute(step: SchedulerOutput) -> ModelRunnerOutput:
        result = execute(step)
        for row, tokens in zip(step.sample_rows.tolist(), result.tokens_per_row(), strict=True):
            steps.setdefault(step.req_ids[row] - first_req_id, []).append(list(tokens))
        return result

    runner.execute = recording_execute  # type: ignore[method-assign]
    try:
        outputs = llm.generate(list(prompts), params)  # type: ignore[arg-type]
    finally:
        del runner.execute
    return Run(outputs, llm.core.stats(), steps)


def inside_accepted_runs(run: Run, request: int) -> list[tuple[int, int]]:
    """(output index, token) of every token that a step of `request` accepted as a draft with
    more tokens after it in the same step: a stop there must cut the rest of that step."""
    found: list[tuple[int, int]] = []
    position = 0
    for tokens in run.steps.get(request, []):
        found.extend((position + i, token) for i, token in enumerate(tokens[:-1]))
        position += len(tokens)
    return found


def first_occurrence_inside_accepted_run(run: Run, request: int) -> tuple[int, int] | None:
    """An (output index, token) inside an accepted run whose token occurs nowhere earlier in the
    output: made a stop token, the request ends right there, inside the run."""
    output = run.outputs[request].outputs[0].token_ids
    for position, token in inside_accepted_runs(run, request):
        if token not in output[:position]:
            return position, token
    return None
