"""A producer told to stop (SIGTERM, as on scale-down) turns unready at once but keeps serving
pulls of the KV it still holds under lease, then exits 0 without waiting for the lease to expire.

Without the drain waiting for leases the producer would exit as soon as the prefill leg answered
(no request in flight), and the consumer would have to recompute (no bytes received).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from baton_engine import contract
from baton_support.wait import wait_for
from tests.kv_transfer.helpers import KEY
from tests.kv_transfer.test_pd_http import NAME, _complete, _metric
from tests.pd_setup import MODEL, pd_environment, serve_args
from tests.server.server_process import ServerProcess, pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.model]

LEASE_SECONDS = 60  # far longer than the test: the exit must come from the pull, not the expiry


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with pd_environment(KEY.decode()):
        started: list[ServerProcess] = []
        try:
            for role in ("producer", "consumer"):
                started.append(
                    ServerProcess(
                        MODEL,
                        *serve_args(role, num_kv_blocks=160, lease_seconds=LEASE_SECONDS, name=NAME),
                        log_path=tmp_path / f"{role}.log",
                    )
                )
            yield started[0], started[1]
        finally:
            for server in started:
                core_pid = server.core_pid
                server.stop(signal.SIGKILL, timeout=10)
                if core_pid is not None and pid_alive(core_pid):
                    wait_for(
                        lambda pid=core_pid: not pid_alive(pid),
                        timeout=10,
                        message=f"core {core_pid} to exit",
                    )


def test_sigterm_keeps_serving_leased_blocks_until_pulled(pair: tuple[ServerProcess, ServerProcess]) -> None:
    producer, consumer = pair
    prompt = "The three primary colours are"
    want = _complete(producer, prompt).json()["choices"][0]["text"]
    first = _complete(producer, prompt, kv_transfer_params={"do_remote_decode": True})
    assert first.status_code == 200, first.text
    kv = first.json()["kv_transfer_params"]
    wait_for(
        lambda: producer.stats()["kv_leases_held"] == 1,
        timeout=10,
        message="the producer to report its lease",
    )

    producer.proc.send_signal(signal.SIGTERM)
    wait_for(
        lambda: producer.answers("/ready") == 503, timeout=30, message="/ready to turn 503 after SIGTERM"
    )
    assert producer.proc.poll() is None  # still up: a lease is held

    received_before = _metric(consumer, contract.M_KV_TRANSFER_BYTES, direction="received")
    second = _complete(consumer, prompt, kv_transfer_params=kv)
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["text"] == want
    assert _metric(consumer, contract.M_KV_TRANSFER_BYTES, direction="received") > received_before

    try:
        code = producer.proc.wait(timeout=LEASE_SECONDS / 2)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the producer did not exit after the pull:\n{producer.log_text()[-3000:]}")
    assert code == 0
    assert "drained; stopping" in producer.log_text()
