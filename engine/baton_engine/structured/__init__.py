"""Structured output: grammars from ``response_format`` and tools (llguidance), token masks."""
