"""The vLLM side of `bench.serving`'s offline comparison, run by the vLLM venv's interpreter.

``<vllm venv>/bin/python bench/vllm_offline.py SPEC OUT``: SPEC is a JSON file written by
`bench.serving` (model folder, token-id prompts, output tokens, engine settings); OUT receives
the generated token ids, the wall time of ``generate`` and the CPU time this process and its
children (vLLM's engine-core process, unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the
core in this process) spent in it. Imports vLLM and the standard library only:
Baton is not installed in that venv.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds of this process (``frontend``: the `LLM`, its scheduler when in-process,
    detokenization) and of its live descendants (``core``: vLLM's engine-core process when
    multiprocessing is on)."""
    import psutil  # a vLLM requirement

    me = psutil.Process()
    core = 0.0
    for child in me.children(recursive=True):
        try:
            core += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return {"frontend": float(sum(me.cpu_times()[:2])), "core": core}


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec: dict[str, Any] = json.loads(open(spec_path).read())
    llm = LLM(
        model=spec["model_dir"],
        dtype="float32",
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        enable_prefix_caching=True,
        enforce_eager=spec["enforce_eager"],
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_tokens"], ignore_eos=True)
    # Warm-up (untimed): a short prompt sharing no block with the measured ones.
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup_prompt"])], params, use_tqdm=False)
    cpu_start, start = _cpu_seconds(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    cpu_end = _cpu_seconds()
    cpu_by_process = {part: cpu_end[part] - cpu_start[part] for part in cpu_end}
    result = {
        "seconds": seconds,
        "cpu_seconds": sum(cpu_by_process.values()),
        "cpu_seconds_by_process": cpu_by_process,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "pid": os.getpid(),
    }
    with open(out_path, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
