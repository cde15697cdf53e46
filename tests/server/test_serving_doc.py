"""docs/serving.md as a user follows it: its shell block (the version, then the server on the
default model), the official client snippet against that server, and the offline `LLM` snippet."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from baton_support.ports import free_port
from baton_support.wait import wait_for
from tests.demo.readme import marked_blocks
from tests.server.server_process import BATON_ENGINE

pytestmark = [pytest.mark.slow, pytest.mark.model]
PAGE = Path(__file__).resolve().parents[2] / "docs/serving.md"
_PYTHON = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _snippet(text: str, marker: str) -> str:
    (code,) = [block for block in _PYTHON.findall(text) if marker in block]
    return code


def test_the_serving_page_runs_as_written(tmp_path: Path) -> None:
    text = PAGE.read_text()
    (block,) = marked_blocks(text)
    version, serve = block.commands
    assert version == "baton-engine --version"
    done = subprocess.run([BATON_ENGINE, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("baton-engine ")

    port = free_port()  # the page's 8000 may be taken on a shared machine
    argv = shlex.split(serve.replace("--port 8000", f"--port {port}"))
    assert argv[:2] == ["baton-engine", "serve"]
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen([BATON_ENGINE, *argv[1:]], stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30.0) as http:

            def ready() -> bool:
                assert server.poll() is None, log_path.read_text()[-3000:]
                try:
                    return http.get("/ready").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(ready, timeout=300, interval=0.2, message="the documented server to be ready")
            assert f"serving smollm2-135m-instruct on http://127.0.0.1:{port} (" in log_path.read_text()
        client_code = _snippet(text, "openai.OpenAI").replace(":8000/", f":{port}/")
        client_code += "\nassert reply.choices[0].message.content, reply\nprint('client ok')\n"
        done = subprocess.run(
            [sys.executable, "-c", client_code], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().endswith("client ok")
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0

    offline = _snippet(text, "from baton_engine import LLM, SamplingParams")
    done = subprocess.run([sys.executable, "-c", offline], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.strip()  # two prints: ids, text (may span lines), finish reason
    assert printed.startswith("[") and "\n[1, 2, 3] " in printed
    assert printed.endswith((" stop", " length"))
    assert printed.count(" stop") + printed.count(" length") >= 2
