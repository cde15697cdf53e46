"""Scheduler overhead per step: `schedule()` + `postprocess()` with N running decode sequences.

Case "decode": N sequences (distinct 512-token prompts, block 16, prefix caching on,
ignore_eos) are prefilled first (not timed); then 200 steps of schedule + postprocess (+ the
KV-event drain) are timed. The stand-in model's output for every step is precomputed, so no model
work is timed; it is what the runners return for a step without drafts (the sampled tokens as
one array, `ModelRunnerOutput.sampled_token_array`), so the timed path is production's. Case
"mixed": the same, plus a new 512-token prompt every 10 steps (its prefill runs in the same step
as the decodes). Zero preemptions is asserted.

Each case is timed `--repeats` (default 10) times (consecutive 200-step windows on the same scheduler) and
the fastest window is reported (the machine is shared; the fastest window is the least
disturbed one), in wall-clock time and, as ``cpu_us_per_seq_step``, in process CPU time (which
a loaded machine disturbs less). KV events are recorded (the heavier setting).
Per-sequence figures divide by N, also in the mixed case. Run: ``python -m bench.scheduler --json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from baton_engine.core.request import Request
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler import Scheduler
from baton_engine.core.scheduler_output import ModelRunnerOutput

PROMPT_LEN = 512
BLOCK_SIZE = 16
STEPS = 200
MIXED_EVERY = 10
VOCAB = 32000
EOS = 2
SIZES = (64, 256, 1024)


class _Bench:
    def __init__(self, n: int, repeats: int, seed: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(seed)
        extra = repeats * STEPS // MIXED_EVERY + 8
        # Room for every sequence to grow through warm-up (< 1024 steps) and all windows.
        max_len = PROMPT_LEN + 1024 + repeats * STEPS
        self.scheduler = Scheduler(
            num_blocks=(n + extra) * -(-max_len // BLOCK_SIZE),
            block_size=BLOCK_SIZE,
            max_num_seqs=n + extra,
            max_num_batched_tokens=8192,
            max_model_len=max_len,
            enable_chunked_prefill=True,
            enable_prefix_caching=True,
            eos_token_id=EOS,
        )
        self.params = SamplingParams(temperature=0.0, max_tokens=max_len, ignore_eos=True)
        self.next_id = 0

    def add_prompt(self) -> None:
        # Distinct prompts: the first token is unique per request, so no prefix is shared.
        prompt = self.rng.integers(3, VOCAB, PROMPT_LEN).tolist()
        prompt[0] = 100_000 + self.next_id
        self.scheduler.add(Request(self.next_id, prompt, self.params))
        self.next_id += 1

    def warm_up(self) -> None:
        for _ in range(self.n):
            self.add_prompt()
        s = self.scheduler
        while s.waiting or s.batch.num_decode < self.n:
            out = s.schedule()
            s.postprocess(out, self._output(out.step_id, len(out.sample_rows)))
            s.kv_cache_manager.take_events()

    def _output(self, step_id: int, rows: int) -> ModelRunnerOutput:
        # What the runners return for a step without drafts: the sampled tokens as one array.
        tokens = self.rng.integers(3, VOCAB, rows)
        return ModelRunnerOutput(step_id=step_id, sampled_token_array=tokens)

    def window(self, mixed: bool) -> tuple[float, float]:
        """Time STEPS steps; returns (wall seconds, process CPU seconds)."""
        s = self.scheduler
        first_step = s._step_id + 1
        rows = s.batch.num_decode
        outputs = []
        for i in range(STEPS):
            if mixed and i % MIXED_EVERY == 0:
                rows += 1
            outputs.append(self._output(first_step + i, rows))
        prompts_before = self.next_id
        start = time.perf_counter()
        start_cpu = time.process_time()
        for i in range(STEPS):
            if mixed and i % MIXED_EVERY == 0:
                self.add_prompt()
            out = s.schedule()
            s.postprocess(out, outputs[i])
            s.kv_cache_manager.take_events()
        elapsed = time.perf_counter() - start
        elapsed_cpu = time.process_time() - start_cpu
        assert s.num_preemptions == 0, "benchmark must run without preemption"
        assert not s.waiting and s.batch.num_decode == s.batch.num_rows
        assert s.batch.num_decode == self.n + (self.next_id - prompts_before) + (prompts_before - self.n)
        return elapsed, elapsed_cpu


def run(repeats: int, sizes: tuple[int, ...]) -> dict[str, object]:
    result: dict[str, object] = {"us_per_step": {}, "us_per_seq_step": {}, "cpu_us_per_seq_step": {}}
    mixed: dict[str, dict[str, float]] = {"us_per_step": {}, "us_per_seq_step": {}, "cpu_us_per_seq_step": {}}
    load_before = os.getloadavg()[0]
    for n in sizes:
        for is_mixed, target in ((False, result), (True, mixed)):
            bench = _Bench(n, repeats, seed=n)
            bench.warm_up()
            windows = [bench.window(is_mixed) for _ in range(repeats)]
            per_step = min(wall for wall, _ in windows) / STEPS * 1e6
            cpu_per_step = min(cpu for _, cpu in windows) / STEPS * 1e6
            target["us_per_step"][str(n)] = round(per_step, 2)  # type: ignore[index]
            target["us_per_seq_step"][str(n)] = round(per_step / n, 4)  # type: ignore[index]
            target["cpu_us_per_seq_step"][str(n)] = round(cpu_per_step / n, 4)  # type: ignore[index]
    result["mixed"] = mixed
    result["config"] = {
        "prompt_len": PROMPT_LEN,
        "block_size": BLOCK_SIZE,
        "steps": STEPS,
        "mixed_new_prompt_every": MIXED_EVERY,
        "repeats": repeats,
        "reported": "fastest window (wall clock); cpu_* = process CPU time of the fastest window",
        "kv_events": True,
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sizes", type=str, default=",".join(str(n) for n in SIZES))
    parser.add_argument("--quick", action="store_true", help="N = 16 and 64, 2 windows each: a smoke run")
    args = parser.parse_args()
    sizes = (16, 64) if args.quick else tuple(int(x) for x in args.sizes.split(","))
    result = {"bench": "scheduler", "quick": args.quick, **run(2 if args.quick else args.repeats, sizes)}
    if not args.json:
        for key in ("us_per_step", "us_per_seq_step"):
            print(key, result[key], "mixed:", result["mixed"][key])  # type: ignore[index]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
