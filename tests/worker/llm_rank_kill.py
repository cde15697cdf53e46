"""The offline `LLM` at TP=2 with rank 1 SIGKILLed while a request decodes, in a process of its
own (`test_tensor_parallel_failure` runs it: if rank 0 stayed stuck in a collective the process
would exit 1 after `STUCK_GRACE_S`, which must not take pytest with it).

``python -m tests.worker.llm_rank_kill MODEL_DIR KILL_AT_STEP [rank1|self]``; prints one JSON
line: the error `generate` raised, the killed rank's pid, and the live children left after
`close`. With ``self`` this process (rank 0) SIGKILLs itself instead, having printed its ranks'
pids first (``{"ranks": [...]}``): they must die with it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from baton_engine import LLM, SamplingParams
from baton_engine.worker.tp_executor import TensorParallelExecutor
from tests.worker.tp_helpers import live_children


def main(model: str, kill_at_step: int, who: str) -> None:
    llm = LLM(model, tensor_parallel_size=2, tensor_parallel_timeout_seconds=300.0, dtype="float32")
    executor = llm.core.runner
    assert isinstance(executor, TensorParallelExecutor)
    victim = executor.pids[0] if who == "rank1" else os.getpid()
    print(json.dumps({"ranks": executor.pids}), flush=True)
    steps = 0
    execute = executor.execute

    def execute_then_kill(step):  # type: ignore[no-untyped-def]
        nonlocal steps
        steps += 1
        if steps == kill_at_step:  # the request has prefilled and decoded kill_at_step - 1 tokens
            os.kill(victim, signal.SIGKILL)
        return execute(step)

    executor.execute = execute_then_kill  # type: ignore[method-assign]
    started = time.monotonic()
    error: dict[str, str] | None = None
    try:
        llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    except Exception as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    raised_after_s = time.monotonic() - started
    llm.close()
    print(
        json.dumps(
            {
                "error": error,
                "victim": victim,
                "steps": steps,
                "raised_after_s": raised_after_s,
                "children_after_close": live_children(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "rank1")
