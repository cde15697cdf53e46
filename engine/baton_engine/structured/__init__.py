"""Structured output: grammars from ``response_format`` and tools (llguidance), followed per
request in the engine core, applied to the logits as token bitmasks on the device.

- `grammar`: OpenAI fields -> llguidance grammars (torch-free), errors naming the field.
- `matcher`: one request's grammar state (torch-free).
- `manager`: the core's owner of request -> grammar state and of each step's bitmask (the hooks
  the step loop calls are listed there).
- `bitmask`: applying a step's bitmask to the logits with tensor ops only (torch).
"""
