"""The tools the server's tool tests offer (both tool-call formats): their arguments are
bounded, so a random model's forced calls end well within max_tokens."""

from __future__ import annotations

from typing import Any

LOOKUP: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {
                "word": {"type": "string", "maxLength": 8},
                "limit": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["word", "limit"],
            "additionalProperties": False,
        },
    },
}
CLOCK: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "clock",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS: dict[str, dict[str, Any]] = {
    tool["function"]["name"]: tool["function"]["parameters"] for tool in (LOOKUP, CLOCK)
}
"""Each tool's arguments schema, by function name."""


def described(tool: dict[str, Any], description: str) -> dict[str, Any]:
    """`tool` with a description (rendered into the prompt by the chat template)."""
    return {**tool, "function": {**tool["function"], "description": description}}
