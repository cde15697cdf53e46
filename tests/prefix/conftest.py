from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from baton_engine.prefix.publisher import KVEventPublisher
from baton_engine.prefix.wire import ENCODING_ARRAY

GO_DECODER_SRC = Path(__file__).parent / "go_decoder"
CACHE_ROOT = Path.home() / ".cache" / "baton"


@pytest.fixture
def make_publisher() -> Iterator[Callable[..., KVEventPublisher]]:
    """KVEventPublisher on free loopback ports, shut down at teardown. These tests pin the
    array encoding (vLLM v0.22's, and what llm-d-kv-cache v0.8 reads); the current map encoding
    is tested against real vLLM bytes in tests/interop."""
    made: list[KVEventPublisher] = []

    def make(topic: str = "kv@127.0.0.1:8000@smollm2", **kwargs: object) -> KVEventPublisher:
        kwargs.setdefault("replay_endpoint", "tcp://127.0.0.1:*")
        kwargs.setdefault("encoding", ENCODING_ARRAY)
        endpoint = str(kwargs.pop("endpoint", "tcp://127.0.0.1:*"))
        pub = KVEventPublisher(endpoint, topic, **kwargs)  # type: ignore[arg-type]
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.shutdown()


def _go_decoder_key() -> str:
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update((GO_DECODER_SRC / name).read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def go_decoder() -> Path:
    """The llm-d decoder program, built once per source hash under ~/.cache/baton/."""
    binary = CACHE_ROOT / "go_decoder" / _go_decoder_key() / "go_decoder"
    if binary.exists():
        return binary
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if go is None:
        pytest.fail("the llm-d decoder check needs the Go toolchain (`go` on PATH)")
    binary.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "GOMODCACHE": str(CACHE_ROOT / "gomod"),
        "GOCACHE": str(CACHE_ROOT / "gocache"),
        "GOFLAGS": "-mod=readonly -buildvcs=false",
        "CGO_ENABLED": "0",
    }
    partial = binary.with_suffix(".partial")
    subprocess.run(
        [go, "build", "-o", str(partial), "."], cwd=GO_DECODER_SRC, env=env, check=True, timeout=900
    )
    partial.rename(binary)
    return binary
