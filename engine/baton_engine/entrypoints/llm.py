"""The offline API: ``LLM(model=..., **engine settings).generate(prompts, params)``.

Drives the same `EngineCore` as the server, in-process, and matches stop strings with the same
`IncrementalDetokenizer`. Imports nothing server-only (FastAPI, uvicorn, pyzmq).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import run_until_idle
from baton_engine.core.outputs import RequestOutput, TokenLogprobs
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.entrypoints.engine_factory import build_engine_core
from baton_engine.text.detokenizer import IncrementalDetokenizer

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """``stop`` (EOS, stop token or stop string), ``length``, ``abort`` or ``rejected``."""
    finish_message: str | None = None
    stop_string: str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class GenerationOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str = "builtin:smollm2-135m-instruct", **engine_settings: Any) -> None:
        self.config = EngineConfig(model=model, **engine_settings)
        self.core, self.info = build_engine_core(self.config)
        self.tokenizer = self.core.runner.loaded.tokenizer  # type: ignore[attr-defined]
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts; pass one or "
                    "one per prompt"
                )
        results: list[GenerationOutput] = []
        streams: dict[str, tuple[CompletionOutput, IncrementalDetokenizer | None, GenerationOutput]] = {}
        for prompt, params in zip(prompt_list, params_list, strict=True):
            ids = self._encode(prompt)
            result = GenerationOutput(prompt if isinstance(prompt, str) else None, ids)
            results.append(result)
            for j in range(params.n):
                request_id = f"offline-{self._next_id}"
                self._next_id += 1
                child = params if params.n == 1 else _child_params(params, j)
                completion = CompletionOutput(
                    j, "", [], None, logprobs=[] if params.logprobs is not None else None
                )
                result.outputs.append(completion)
                # Only stop strings need text while generating; otherwise decode once at the end.
                text = None
                if self.tokenizer is not None and params.stop:
                    text = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
                streams[request_id] = (completion, text, result)
                self.core.add_request(request_id, ids, self.info.with_extra_eos(child))

        def on_outputs(outputs: list[RequestOutput]) -> None:
            stopped: list[str] = []
            for out in outputs:
                entry = streams.get(out.request_id)
                if entry is None:
                    continue
                completion, text, result = entry
                if completion.finish_reason is not None:
                    continue  # already cut by a stop string; this is the abort's echo
                new_ids, new_logprobs = out.new_token_ids, out.new_logprobs
                delta = text.add(new_ids) if text is not None else None
                if delta is not None:
                    # A speculative step may run past a stop string: keep what precedes it.
                    new_ids = new_ids[: delta.num_ids_kept]
                    new_logprobs = new_logprobs[: delta.num_ids_kept] if new_logprobs else new_logprobs
                completion.token_ids.extend(new_ids)
                if completion.logprobs is not None and new_logprobs:
                    completion.logprobs.extend(new_logprobs)
                result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
                if text is not None and delta is not None:
                    if delta.stopped:
                        completion.finish_reason = "stop"
                        completion.stop_string = delta.stop_string
                        completion.text = text.output_text
                        stopped.append(out.request_id)
                        continue
                if out.finished:
                    if text is None and self.tokenizer is not None:
                        text = IncrementalDetokenizer(self.tokenizer, result.prompt_token_ids)
                        text.add(completion.token_ids)
                    if text is not None:
                        text.finish()
                        completion.text = text.output_text
                    completion.finish_reason = out.finish_reason
                    completion.finish_message = out.finish_message
            if stopped:
                self.core.abort_requests(stopped, "stop string matched")

        run_until_idle(self.core, on_outputs)
        return results

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as token id lists")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("a prompt must not be empty")
        return ids


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [list(items)]  # type: ignore[arg-type]
    return items  # type: ignore[return-value]


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """One of ``n`` parallel completions: distinct seeds so that seeded samples differ."""
    import dataclasses

    seed = None if params.seed is None else (params.seed + index) % 2**63
    return dataclasses.replace(params, n=1, seed=seed)
