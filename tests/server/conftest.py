from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from baton_support.tiny_models import CHAT
from tests.server.server_process import ServerProcess

TINY_SERVER_ARGS = (
    "--num-kv-blocks", "256",
    "--max-model-len", "256",
    "--max-num-seqs", "64",
    "--max-num-batched-tokens", "512",
    "--dtype", "float32",
)  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-chat-model") / "tiny-chat"
    CHAT.save(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    server = ServerProcess(str(tiny_model_dir), *TINY_SERVER_ARGS, log_path=log)
    yield server
    server.stop()


@pytest.fixture()
def start_tiny_server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start extra tiny-model servers in a test; each is stopped (by pid) at teardown."""
    started: list[ServerProcess] = []

    def start(*extra_args: str, wait_ready: bool = True) -> ServerProcess:
        log = tmp_path / f"server-{len(started)}.log"
        server = ServerProcess(
            str(tiny_model_dir), *TINY_SERVER_ARGS, *extra_args, log_path=log, wait_ready=wait_ready
        )
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(signal.SIGKILL, timeout=10)
