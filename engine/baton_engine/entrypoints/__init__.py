"""How an engine is started: `engine_factory` builds one from an `EngineConfig`, `llm` runs it
in-process (the offline API), `core_process` runs it in its own process behind `ipc`.

Importing this package makes OpenMP's waiting threads sleep (``OMP_WAIT_POLICY=PASSIVE``) unless
the environment says otherwise. GNU OpenMP reads the policy once, when torch loads it, and its
default lets a thread that waits at the end of a parallel region spin. Beside any other busy
process the spinning threads take the cores the working ones need: the offline `LLM`, 8 prompts
x 32 tokens on 2 threads at load 16, used 138.6 ms of CPU per token with the default and 19.0 ms
with PASSIVE (203 s vs 24 s; the same tokens). Every entry point (``LLM``, the engine-core and
rank processes) imports this package before torch; a program that imported torch itself first
keeps the policy it started with.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
