"""docs/serving.md's Python snippets as a reader runs them: the official client against a server
on the default model, and the offline `LLM` (its shell block is tests/docs/test_serving_commands.py's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.model]
PAGE = Path(__file__).resolve().parents[2] / "docs/serving.md"
_PYTHON = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _snippet(marker: str) -> str:
    (code,) = [block for block in _PYTHON.findall(PAGE.read_text()) if marker in block]
    return code


def test_the_client_snippet_gets_an_answer(tmp_path: Path) -> None:
    server = ServerProcess(
        "builtin:smollm2-135m-instruct", "--max-model-len", "512", log_path=tmp_path / "log"
    )
    try:
        code = _snippet("openai.OpenAI").replace("127.0.0.1:8000/", f"127.0.0.1:{server.port}/")
        code += "\nassert reply.choices[0].message.content, reply\nprint('client ok')\n"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().endswith("client ok")
    finally:
        assert server.stop() == 0


def test_the_offline_snippet_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _snippet("from baton_engine import LLM, SamplingParams")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    printed = done.stdout.strip()  # two prints: ids, text (may span lines), finish reason
    assert printed.startswith("[") and "\n[1, 2, 3] " in printed
    assert printed.endswith((" stop", " length"))
