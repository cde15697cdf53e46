"""docs/serving.md's first commands as a reader types them: `baton-engine serve` with the
builtin model (on a free port instead of the page's 8000, which another server on a shared
machine may hold) answers a completion, and `baton-engine --version` names the package."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from baton_support.ports import free_port
from baton_support.wait import wait_for
from tests.demo.readme import REPO, shell_blocks

PAGE = REPO / "docs" / "serving.md"
BIN = str(Path(sys.executable).parent)

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_serving_page_commands(tmp_path: Path) -> None:
    serve, version = shell_blocks(PAGE.read_text())[0]
    assert serve == "baton-engine serve --model builtin:smollm2-135m-instruct --port 8000"
    assert version == "baton-engine --version"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}

    done = subprocess.run(["bash", "-c", version], env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "baton-engine 0.1.0")

    port = free_port()
    command = serve.replace("--port 8000", f"--port {port}")
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {command}"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        ready = re.compile(rf"ready in [0-9.]+ s: serving (\S+) on http://127\.0\.0\.1:{port} ")

        def serving() -> str | None:
            assert proc.poll() is None, log.read_text()[-4000:]
            found = ready.search(log.read_text(errors="replace"))
            return found.group(1) if found else None

        model = wait_for(serving, timeout=300, interval=0.5, message="the server's ready line")
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 2
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    assert code == 0, log.read_text()[-4000:]
