"""Structured output: grammars from ``response_format`` and tools (llguidance), followed per
request by the scheduler (torch-free); the runner applies each step's token bitmasks to the
logits (`baton_engine.worker.token_bitmask`).

- `grammar`: OpenAI fields -> llguidance grammars, errors naming the field.
- `matcher`: one request's grammar state.
- `manager`: the scheduler's owner of request -> grammar state and of each step's bitmasks (the
  hooks it calls are listed there).
"""
