"""Speculative decoding with n-gram drafts: measured on CPU, projected for the GPU.

CPU part (always): SmolLM2-135M-Instruct (builtin GGUF, float32) on a repetitive workload — chat
requests that ask the model to repeat, rewrite or summarise a paragraph given in the prompt, so
its output reuses the prompt's n-grams. All requests are submitted together to one offline `LLM`,
greedy, once with speculation off and once on (same process, same prompts, warm-up not timed,
best of ``--repeats``). Reported: ``acceptance_rate`` (accepted / proposed drafts),
``tokens_per_forward`` (mean tokens a verifying row gains per forward, accepted drafts + 1),
``speedup_cpu`` (wall time off / on), whether the outputs are identical, and the acceptance
trace (accepted drafts per verify row) that the GPU projection uses.

GPU part (``--device cuda``): verify-step cost on the Llama-3.2-1B shape with random bfloat16
weights — one engine step of B decode rows carrying K drafts each, K = 0..8, through the engine's
own runner (the GPU runner replays captured graphs for plain decode steps and, padded to the next
captured query length, for verify steps) — and ``speedup_gpu_projected`` = max over K of
tokens_per_row_step(K) x t(0) / t(K), where tokens_per_row_step(K) comes from the CPU trace
(each verify row keeps min(accepted, K) drafts + 1; rows without a draft gain 1). Random
weights would accept nothing, hence the CPU trace: the figure is a projection and labelled as
such. On CPU the GPU fields are null.

``python -m bench.speculative --json`` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.shapes import LLAMA_32_1B

MODEL = "builtin:smollm2-135m-instruct"

PARAGRAPHS = [
    "The river town wakes slowly. Fishermen check their nets at the pier, the baker opens the "
    "shutters of his shop, and the first bus of the day crosses the old stone bridge. By eight "
    "o'clock the market square is full of voices, bicycles and the smell of fresh bread.",
    "To reset the router, unplug the power cable, wait thirty seconds, and plug it back in. When "
    "the status light turns green, open the settings page, log in with the administrator "
    "password, and check that the wireless network name and the password are still correct.",
    "Our team met on Monday to plan the release. We agreed to freeze new features on Friday, to "
    "spend next week on testing and documentation, and to publish the release notes together "
    "with the new version. Anna will coordinate the testing and Ben will write the notes.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide "
    "to make sugar and oxygen. It takes place in the chloroplasts of the leaf cells, and the "
    "oxygen it releases is the oxygen that most living things on Earth breathe.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Rewrite the following text with the same words, fixing nothing:\n\n{text}",
    "Copy this paragraph:\n\n{text}",
    "Summarize the following text, reusing its own sentences:\n\n{text}",
]

LLAMA_32_1B_SHAPE: dict[str, Any] = asdict(LLAMA_32_1B)
TINY_SHAPE: dict[str, Any] = dict(
    family="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    name="tiny-shape",
)


# -- CPU: measured --------------------------------------------------------------------------
@dataclass
class Trace:
    """What a run's steps did (speculative or not)."""

    drafts: list[int] = field(default_factory=list)
    """Drafts carried by each verify row (a decode row that carried drafts)."""
    accepted: list[int] = field(default_factory=list)
    """Accepted drafts of each verify row."""
    decode_row_steps: int = 0
    """Decode rows over all steps, with or without drafts."""
    forwards: int = 0

    def acceptance_rate(self) -> float:
        return sum(self.accepted) / sum(self.drafts) if self.drafts else 0.0

    def tokens_per_forward(self) -> float:
        return 1.0 + sum(self.accepted) / len(self.accepted) if self.accepted else 1.0

    def acceptance_by_position(self, k: int) -> list[float]:
        accepted = np.asarray(self.accepted, dtype=np.int64)
        rows = max(len(accepted), 1)
        return [round(float((accepted > j).sum()) / rows, 4) for j in range(k)]


def workload_prompts(llm: Any, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        text = PARAGRAPHS[i % len(PARAGRAPHS)]
        instruction = INSTRUCTIONS[(i // len(PARAGRAPHS) + i) % len(INSTRUCTIONS)]
        messages = [{"role": "user", "content": instruction.format(text=text)}]
        prompts.append(llm.tokenizer.encode_chat(messages, add_generation_prompt=True))
    return prompts


def timed_generate(
    llm: Any, prompts: list[list[int]], params: Any, trace: Trace | None
) -> tuple[float, list[list[int]]]:
    runner = llm.core.runner
    execute = runner.execute

    def tracing_execute(step: Any) -> Any:
        result = execute(step)
        if trace is not None:
            trace.forwards += 1
            trace.decode_row_steps += step.num_decode_rows
            drafts = step.num_draft_tokens
            for row, tokens in zip(step.sample_rows.tolist(), result.tokens_per_row(), strict=True):
                if row < step.num_decode_rows and drafts[row]:
                    trace.drafts.append(int(drafts[row]))
                    trace.accepted.append(len(tokens) - 1)
        return result

    runner.execute = tracing_execute
    try:
        started, cpu_started = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    finally:
        del runner.execute
    return elapsed, cpu, [out.outputs[0].token_ids for out in outputs]


def cpu_part(args: argparse.Namespace, model: str = MODEL) -> tuple[dict[str, Any], Trace]:
    from baton_engine.core.sampling_params import SamplingParams
    from baton_engine.entrypoints.llm import LLM

    common = dict(dtype="float32", num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=2048)
    off = LLM(model, **common)
    on = LLM(
        model,
        **common,
        speculative="ngram",
        num_speculative_tokens=args.k,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
    )
    prompts = workload_prompts(off, args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=4)
    for llm in (off, on):
        llm.generate(prompts[:1], warm)
    times_off, times_on, cpu_off, cpu_on = [], [], [], []
    trace_off, trace = Trace(), Trace()
    outputs_off: list[list[int]] = []
    outputs_on: list[list[int]] = []
    for repeat in range(args.repeats):
        t, c, outputs_off = timed_generate(off, prompts, params, trace_off if repeat == 0 else None)
        times_off.append(t)
        cpu_off.append(c)
        t, c, outputs_on = timed_generate(on, prompts, params, trace if repeat == 0 else None)
        times_on.append(t)
        cpu_on.append(c)
    generated = sum(len(o) for o in outputs_on)
    result = {
        "model": model if model == MODEL else "tiny random Llama (chat tokenizer)",
        "num_prompts": len(prompts),
        "mean_prompt_tokens": round(statistics.mean(len(p) for p in prompts), 1),
        "max_tokens": args.max_tokens,
        "generated_tokens": generated,
        "k": args.k,
        "ngram_min": args.ngram_min,
        "ngram_max": args.ngram_max,
        "acceptance_rate": round(trace.acceptance_rate(), 4),
        "tokens_per_forward": round(trace.tokens_per_forward(), 4),
        "acceptance_by_position": trace.acceptance_by_position(args.k),
        "verify_rows": len(trace.accepted),
        "decode_row_steps_off": trace_off.decode_row_steps,
        "decode_row_steps_on": trace.decode_row_steps,
        "forwards_off": trace_off.forwards,
        "forwards_on": trace.forwards,
        "seconds_off": [round(t, 3) for t in times_off],
        "seconds_on": [round(t, 3) for t in times_on],
        "cpu_seconds_off": [round(t, 3) for t in cpu_off],
        "cpu_seconds_on": [round(t, 3) for t in cpu_on],
        "speedup_cpu": round(min(times_off) / min(times_on), 3),
        "speedup_cpu_process_time": round(min(cpu_off) / min(cpu_on), 3),
        "outputs_identical": outputs_on == outputs_off,
        "sample_output": on.tokenizer.decode(outputs_on[0])[:300],
    }
    return result, trace


# -- GPU: verify-step cost, projected speedup ------------------------------------------------
def random_weights(
    shape: dict[str, Any], dtype: torch.dtype, device: str, seed: int = 0
) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d = shape["hidden_size"], shape["head_dim"]

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones() -> torch.Tensor:
        return torch.ones(h, device=device, dtype=dtype)

    weights = {"model.embed_tokens.weight": normal(shape["vocab_size"], h), "model.norm.weight": ones()}
    for i in range(shape["num_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = ones()
        weights[p + "post_attention_layernorm.weight"] = ones()
        weights[p + "self_attn.q_proj.weight"] = normal(shape["num_heads"] * d, h)
        weights[p + "self_attn.k_proj.weight"] = normal(shape["num_kv_heads"] * d, h)
        weights[p + "self_attn.v_proj.weight"] = normal(shape["num_kv_heads"] * d, h)
        weights[p + "self_attn.o_proj.weight"] = normal(h, shape["num_heads"] * d)
        weights[p + "mlp.gate_proj.weight"] = normal(shape["intermediate_size"], h)
        weights[p + "mlp.up_proj.weight"] = normal(shape["intermediate_size"], h)
        weights[p + "mlp.down_proj.weight"] = normal(h, shape["intermediate_size"])
    if not shape["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(shape["vocab_size"], h)
    return weights


def _build_runner(
    shape: dict[str, Any], device: str, dtype_name: str, engine_settings: dict[str, Any]
) -> Any:
    from baton_engine.config import EngineConfig
    from baton_engine.entrypoints import engine_factory
    from baton_engine.model.config import ModelConfig
    from baton_engine.model.llama import build_model
    from baton_engine.model.loader.model_loading import LoadedModel
    from baton_engine.model.loader.reference import ResolvedModel
    from baton_engine.worker.model_runner import ModelRunner, resolve_dtype

    config = ModelConfig(**shape)
    dtype = resolve_dtype(dtype_name, torch.device(device))
    model = build_model(config, random_weights(shape, dtype, device), dtype, device)
    loaded = LoadedModel(
        model, config, None, config.name, ResolvedModel("safetensors", Path("/nonexistent"), config.name)
    )
    engine_config = EngineConfig(model=config.name, device=device, dtype=dtype_name, **engine_settings)
    # The runner the engine would pick on this device (the GPU runner where one exists).
    build = getattr(engine_factory, "build_model_runner", None)
    runner = build(engine_config, loaded) if build is not None else ModelRunner(engine_config, loaded)
    return runner, engine_config


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def verify_step_costs(
    shape: dict[str, Any],
    device: str,
    *,
    batch_size: int,
    context_len: int,
    ks: list[int],
    repeats: int,
    dtype_name: str,
    info: dict[str, Any] | None = None,
) -> dict[int, float]:
    """Median milliseconds of one engine step with `batch_size` decode rows carrying K drafts.

    `info`, when given, receives which runner ran the steps and, for the GPU runner, how many
    verify steps replayed a captured graph and for which query lengths graphs exist."""
    from baton_engine.core.request import Request
    from baton_engine.core.sampling_params import SamplingParams
    from baton_engine.core.scheduler import Scheduler

    max_k = max(ks)
    needed_len = context_len + (repeats + 2) * len(ks) * (max_k + 1) + 16
    settings = dict(
        max_num_seqs=max(batch_size, 1),
        max_num_batched_tokens=max(batch_size * context_len, batch_size * (max_k + 1), 2048),
        max_model_len=needed_len,
        num_kv_blocks=batch_size * (needed_len // 16 + 2),
        speculative="ngram",
        num_speculative_tokens=max_k,
    )
    runner, engine_config = _build_runner(shape, device, dtype_name, settings)
    scheduler = Scheduler.from_config(engine_config, num_blocks=runner.num_blocks, eos_token_id=None)
    rng = np.random.default_rng(0)
    vocab = shape["vocab_size"]
    for i in range(batch_size):
        prompt = rng.integers(0, vocab, size=context_len).tolist()
        scheduler.add(
            Request(i, prompt, SamplingParams(temperature=0.0, max_tokens=needed_len, ignore_eos=True))
        )
    while scheduler.batch.num_decode < batch_size:  # prefill everything first
        out = scheduler.schedule()
        scheduler.postprocess(out, runner.execute(out))
    costs: dict[int, float] = {}
    for k in ks:
        samples = []
        for repeat in range(repeats + 2):  # two warm-up steps per K (graph capture, autotuning)
            drafts = {
                request.req_id: rng.integers(0, vocab, size=k).tolist()
                for request in scheduler.decoding_requests()
            }
            out = scheduler.schedule(drafts)
            _sync(device)
            started = time.perf_counter()
            result = runner.execute(out)
            _sync(device)
            if repeat >= 2:
                samples.append((time.perf_counter() - started) * 1e3)
            scheduler.postprocess(out, result)
        costs[k] = statistics.median(samples)
    if info is not None:
        info["runner"] = type(runner).__name__
        if hasattr(runner, "verify_graph_steps"):
            info["verify_graph_steps"] = runner.verify_graph_steps
            info["verify_graph_query_lens"] = list(runner.verify_query_lens)
            info["graph_batch_sizes"] = list(runner.graph_sizes)
            info["graph_capture_seconds"] = round(runner.capture_seconds, 2)
            info["graph_capture_mib"] = round(runner.capture_bytes / 2**20, 1)
    return costs


def project(trace: Trace, costs: dict[int, float], k_measured: int) -> dict[str, Any]:
    """tokens per decode row-step at K from the trace (K <= the traced K), and the speedup."""
    accepted = np.asarray(trace.accepted, dtype=np.int64)
    row_steps = max(trace.decode_row_steps, 1)
    no_draft_rows = row_steps - len(accepted)
    table = {}
    for k, cost in sorted(costs.items()):
        if k == 0 or k > k_measured:
            continue
        tokens = (no_draft_rows + (1 + np.minimum(accepted, k)).sum()) / row_steps
        table[k] = {
            "tokens_per_row_step": round(float(tokens), 4),
            "verify_ms": round(cost, 3),
            "speedup": round(float(tokens) * costs[0] / cost, 3),
        }
    best = max(table.items(), key=lambda item: item[1]["speedup"]) if table else None
    return {
        "decode_ms_k0": round(costs[0], 3),
        "verify_ms_by_k": {str(k): round(v, 3) for k, v in sorted(costs.items())},
        "projection_by_k": {str(k): v for k, v in table.items()},
        "best_k_gpu": best[0] if best else None,
        "speedup_gpu_projected": best[1]["speedup"] if best else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU verify-step part")
    parser.add_argument("--k", type=int, default=8, help="draft tokens per step on CPU (also the traced K)")
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1, help="timed CPU runs per mode (best is kept)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    parser.add_argument("--gpu-shape", choices=["llama-3.2-1b", "tiny"], default="llama-3.2-1b")
    parser.add_argument(
        "--gpu-batch-size", type=int, default=0, help="rows per verify step (0: --num-prompts)"
    )
    parser.add_argument("--gpu-context", type=int, default=512, help="context tokens per row")
    parser.add_argument("--gpu-repeats", type=int, default=10)
    parser.add_argument(
        "--save-trace", default="", help="write the CPU part's results and acceptance trace to this JSON file"
    )
    parser.add_argument(
        "--trace-from",
        default="",
        help="skip the CPU part and project from a trace saved by --save-trace (for a GPU machine that "
        "lacks the SmolLM2 package)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of both parts on this device: a tiny random chat model, 2 prompts x 16 tokens, "
        "K=4, and the verify-step projection on the tiny shape (2 rows x 32 tokens, 2 repeats)",
    )
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.k, args.repeats = 2, 16, 4, 1
        args.gpu_shape, args.gpu_batch_size, args.gpu_context, args.gpu_repeats = "tiny", 2, 32, 2
    if args.threads:
        torch.set_num_threads(args.threads)

    result: dict[str, Any] = {
        "bench": "speculative",
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": [round(os.getloadavg()[0], 2)],
    }
    if args.trace_from:
        saved = json.loads(Path(args.trace_from).read_text())
        cpu, trace = saved["cpu"], Trace(**saved["trace"])
        args.k = saved["k"]
        cpu["cpu_part_from"] = args.trace_from
    elif args.quick:  # a tiny random chat model: the whole path in seconds, no figure
        from baton_support.tiny_models import CHAT

        with tempfile.TemporaryDirectory(prefix="bench-speculative-") as tmp:
            CHAT.save(Path(tmp))
            cpu, trace = cpu_part(args, tmp)
    else:
        cpu, trace = cpu_part(args)
    if args.save_trace:
        Path(args.save_trace).write_text(json.dumps({"k": args.k, "cpu": cpu, "trace": asdict(trace)}))
    result.update(cpu)
    result["acceptance_trace"] = {
        "verify_rows": len(trace.accepted),
        "decode_row_steps": trace.decode_row_steps,
        "accepted_histogram": np.bincount(
            np.asarray(trace.accepted, dtype=np.int64), minlength=args.k + 1
        ).tolist(),
    }
    gpu: dict[str, Any] = {
        "gpu_device": None,
        "speedup_gpu_projected": None,
        "speedup_gpu_is_projection": True,
    }
    if args.device != "cpu" or args.quick:
        shape = LLAMA_32_1B_SHAPE if args.gpu_shape == "llama-3.2-1b" else TINY_SHAPE
        batch = args.gpu_batch_size or args.num_prompts
        runner_info: dict[str, Any] = {}
        costs = verify_step_costs(
            shape,
            args.device,
            batch_size=batch,
            context_len=args.gpu_context,
            ks=list(range(0, 9)),
            repeats=args.gpu_repeats,
            dtype_name="bfloat16" if args.device.startswith("cuda") else "float32",
            info=runner_info,
        )
        gpu.update(project(trace, costs, args.k))
        gpu["gpu_device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
        gpu["gpu_shape"] = shape["name"]
        gpu["gpu_batch_size"] = batch
        gpu["gpu_context"] = args.gpu_context
        gpu["gpu_runner"] = runner_info
    result.update(gpu)
    result["load_average_1m"].append(round(os.getloadavg()[0], 2))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
