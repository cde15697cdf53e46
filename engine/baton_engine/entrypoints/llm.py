"""The offline API: ``LLM(model=..., **engine settings).generate(prompts, params)``.

``from baton_engine import LLM, SamplingParams``. Drives the same `EngineCore` as the server,
in-process, and matches stop strings with the same `IncrementalDetokenizer`. Imports nothing
server-only (FastAPI, uvicorn, pyzmq).

Bad input raises `ValueError` (or `TypeError` for a wrong type) naming the argument, before
anything reaches the engine. A call that fails later (an error in a forward, KeyboardInterrupt)
aborts its requests and frees their KV blocks, so the `LLM` stays usable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import run_until_idle
from baton_engine.core.outputs import RequestOutput, TokenLogprobs
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.entrypoints.engine_factory import build_engine_core, close_runner
from baton_engine.structured.grammar import validate_grammar
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
        """`engine_settings`: any `EngineConfig` field (``max_model_len=...``, ``device="cuda"``);
        an unknown or invalid one raises pydantic's ValidationError naming it."""
        self.config = EngineConfig(model=model, **engine_settings)
        if self.config.cpu_threads is not None and self.config.device.split(":")[0] == "cpu":
            import torch

            # The served core gets its threads when its process starts; this engine runs in the
            # caller's process, which keeps torch's count unless cpu_threads is given.
            torch.set_num_threads(self.config.cpu_threads)
        self.core, self.info = build_engine_core(self.config)
        self.tokenizer = self.info.tokenizer
        self._next_id = 0

    def close(self) -> None:
        """Stop the tensor-parallel rank processes, if any (they also stop when this process
        exits); the `LLM` cannot generate afterwards."""
        close_runner(self.core)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, Sequence):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts; pass one or "
                    "one per prompt"
                )
        else:
            raise TypeError(
                "sampling_params must be a SamplingParams or a list of them, got "
                f"{type(sampling_params).__name__}"
            )
        for i, params in enumerate(params_list):
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(params).__name__}")
            if params.grammar is not None:
                self._check_grammar(params.grammar, f"sampling_params[{i}].grammar")
        # Every prompt is checked before any request reaches the engine: a bad one queues nothing.
        encoded = [self._encode(prompt, i) for i, prompt in enumerate(prompt_list)]
        results: list[GenerationOutput] = []
        streams: dict[str, tuple[CompletionOutput, IncrementalDetokenizer | None, GenerationOutput]] = {}
        try:
            self._add_requests(prompt_list, encoded, params_list, results, streams)
            self._run(streams)
        except BaseException:
            self._abort(list(streams))
            raise
        return results

    def _add_requests(
        self,
        prompt_list: list[Prompt],
        encoded: list[list[int]],
        params_list: list[SamplingParams],
        results: list[GenerationOutput],
        streams: dict[str, tuple[CompletionOutput, IncrementalDetokenizer | None, GenerationOutput]],
    ) -> None:
        for prompt, ids, params in zip(prompt_list, encoded, params_list, strict=True):
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

    def _run(
        self, streams: dict[str, tuple[CompletionOutput, IncrementalDetokenizer | None, GenerationOutput]]
    ) -> None:
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

    def _abort(self, request_ids: list[str]) -> None:
        """After a failed call: finish its requests and free their KV blocks (the core's step
        loop runs until they are gone)."""
        self.core.abort_requests(request_ids, "generate() failed")
        run_until_idle(self.core, lambda outputs: None)

    def _check_grammar(self, grammar: str, param: str) -> None:
        if self.core.scheduler.structured_output is None:
            raise ValueError(f"{param}: this model has no tokenizer, so its output cannot follow a grammar")
        validate_grammar(grammar, param)  # StructuredOutputError is a ValueError naming `param`

    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompts[{index}]: this model has no tokenizer; pass prompts as token id lists"
                )
            ids: list[int] = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(_is_token_id(t) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise TypeError(f"prompts[{index}] must be a string or a list of token ids (ints)")
        if not ids:
            raise ValueError(f"prompts[{index}]: a prompt must not be empty")
        vocab = self.info.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompts[{index}]: token id {bad} is out of range [0, {vocab})")
        return ids


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(
            f"prompts must be a string, a list of token ids or a list of those, got {type(prompts).__name__}"
        )
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [list(items)]  # type: ignore[arg-type]
    return items  # type: ignore[return-value]


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """One of ``n`` parallel completions: distinct seeds so that seeded samples differ."""
    import dataclasses

    seed = None if params.seed is None else (params.seed + index) % 2**63
    return dataclasses.replace(params, n=1, seed=seed)
