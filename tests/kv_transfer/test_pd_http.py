"""P/D through two real `baton-engine serve` processes (SmolLM2, CPU, float32) on 127.0.0.1.

The test plays the router: the prefill leg goes to the producer with
``kv_transfer_params: {do_remote_decode: true}``, the decode leg to the consumer with the signed
params the producer returned. Greedy text must equal a single engine's for 16 prompts (some of
which partly hit the consumer's prefix cache). Faults: forged/unsigned params (400, no outbound
connection), an unpulled lease (freed at expiry), the producer killed between the legs
(the consumer recomputes).
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from baton_engine import contract
from baton_engine.contract import KVTransferParams
from baton_support.wait import wait_for
from tests.kv_transfer.helpers import KEY
from tests.pd_setup import MODEL, PREFIXED, SHARED_PREFIX, TEXTS, pd_environment, serve_args
from tests.server.server_process import ServerProcess, pid_alive

# Two model loads and ~60 requests: minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(1800)]

NAME = "smollm2"
# Every decode leg must pull within this of its prefill leg (a loaded machine can take a second
# or more between the legs); the expiry tests wait this long.
LEASE_SECONDS = 10


class Servers:
    """A producer and a consumer. The producer also serves as the single-engine reference
    (requests without kv_transfer_params run there as on any engine)."""

    def __init__(self, log_dir: Path) -> None:
        self.started: list[ServerProcess] = []
        self.core_pids: dict[int, int] = {}
        self.producer = self._start(log_dir / "producer.log", "producer")
        self.consumer = self._start(log_dir / "consumer.log", "consumer")

    def _start(self, log: Path, role: str) -> ServerProcess:
        args = serve_args(role, num_kv_blocks=160, lease_seconds=LEASE_SECONDS, name=NAME)
        server = ServerProcess(MODEL, *args, log_path=log)
        self.started.append(server)
        self.core_pids[server.pid] = int(server.stats()["core_pid"])
        return server

    def stop(self) -> None:
        for server in self.started:
            server.stop(signal.SIGKILL, timeout=10)
            core_pid = self.core_pids.get(server.pid)
            if core_pid is not None and pid_alive(core_pid):
                wait_for(
                    lambda pid=core_pid: not pid_alive(pid), timeout=10, message=f"core {core_pid} to exit"
                )


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with pd_environment(KEY.decode()):
        started = Servers(tmp_path_factory.mktemp("pd-http"))
        try:
            yield started
        finally:
            started.stop()


def _complete(server: ServerProcess, prompt: str, **extra: Any) -> Any:
    body = {"model": NAME, "prompt": prompt, "temperature": 0, "max_tokens": 10, **extra}
    return server.http.post("/v1/completions", json=body)


def _pd(servers: Servers, prompt: str) -> dict[str, Any]:
    first = _complete(servers.producer, prompt, kv_transfer_params={"do_remote_decode": True})
    assert first.status_code == 200, first.text
    kv = first.json()["kv_transfer_params"]
    assert first.json()["usage"]["completion_tokens"] == 1
    assert (kv["host"], kv["block_size"], kv["dtype"], kv["layout"]) == (
        "127.0.0.1",
        16,
        "float32",
        contract.KV_LAYOUT,
    )
    second = _complete(servers.consumer, prompt, kv_transfer_params=kv)
    assert second.status_code == 200, second.text
    result: dict[str, Any] = second.json()
    return result


def test_pd_matches_single_engine(servers: Servers) -> None:
    warm = _complete(servers.consumer, SHARED_PREFIX + "Question: warm the cache.")
    assert warm.status_code == 200
    prompts = TEXTS + [SHARED_PREFIX + s for s in PREFIXED]
    for prompt in prompts:
        want = _complete(servers.producer, prompt).json()
        got = _pd(servers, prompt)
        assert got["choices"][0]["text"] == want["choices"][0]["text"], prompt
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
        if prompt.startswith(SHARED_PREFIX):
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    servers.producer.wait_idle()
    servers.consumer.wait_idle()
    received = _metric(servers.consumer, contract.M_KV_TRANSFER_BYTES, direction="received")
    assert received > 0
    wait_for(
        lambda: _metric(servers.producer, contract.M_KV_TRANSFER_BYTES, direction="sent") == received,
        timeout=30,
        message="the producer's sent bytes to match the consumer's received bytes",
    )
    assert _metric(servers.consumer, contract.M_KV_TRANSFER_SECONDS + "_count", role="consumer") == len(
        prompts
    )


def _streamed_text(server: ServerProcess, body: dict[str, Any]) -> str:
    import json

    text = []
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line.removeprefix("data: "))
                text += [c["text"] for c in chunk.get("choices", [])]
    return "".join(text)


def test_vllm_proxy_request_shapes(servers: Servers) -> None:
    """What vLLM's P/D proxy sends (its toy proxy): the prefill leg is the client's body with
    stream off, max_tokens 1, no stream_options and the connector's request-side params (every
    remote_* key null); the decode leg is the client's body plus the prefill answer's
    kv_transfer_params, passed through untouched (opaque to the proxy)."""
    client_body = {
        "model": NAME,
        "prompt": TEXTS[1],
        "temperature": 0,
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    want = _complete(servers.producer, TEXTS[1]).json()["choices"][0]["text"]
    expired = _metric(servers.producer, contract.M_KV_LEASES_EXPIRED)
    prefill_body = {
        **client_body,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
        "stream": False,
        "max_tokens": 1,
    }
    del prefill_body["stream_options"]
    headers = {"Authorization": "Bearer EMPTY", "X-Request-Id": "vllm-proxy-1"}
    first = servers.producer.http.post("/v1/completions", json=prefill_body, headers=headers)
    assert first.status_code == 200, first.text
    kv = first.json()["kv_transfer_params"]
    assert first.json()["usage"]["completion_tokens"] == 1
    got = _streamed_text(servers.consumer, {**client_body, "kv_transfer_params": kv})
    assert got == want
    servers.producer.wait_idle()  # every block freed: by the consumer's pull, not by expiry
    assert _metric(servers.producer, contract.M_KV_LEASES_EXPIRED) == expired


def _metric(server: ServerProcess, name: str, **labels: str) -> float:
    """One sample from the server's /metrics (after its stats caught up with the core)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(server.http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"{name}{labels} not in {server.url}/metrics")


def test_forged_or_unsigned_params_get_400_and_no_connection(servers: Servers) -> None:
    good = _complete(servers.producer, "Forgery target", kv_transfer_params={"do_remote_decode": True})
    kv = good.json()["kv_transfer_params"]
    with socket.create_server(("127.0.0.1", 0)) as trap:
        trap.setblocking(False)
        aimed = {**kv, "port": trap.getsockname()[1]}  # signature no longer matches
        cases = [
            (aimed, "kv_transfer_params.signature: does not match"),
            ({**kv, "signature": ""}, "kv_transfer_params.signature: missing"),
            ({**kv, "block_ids": "zero"}, "kv_transfer_params.block_ids: wrong type str"),
            ({"do_remote_decode": False}, "kv_transfer_params.do_remote_decode: unknown field"),
        ]
        for params, message in cases:
            response = _complete(servers.consumer, "Forgery target", kv_transfer_params=params)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert message in error["message"] and error["param"] == "kv_transfer_params"
        with pytest.raises(BlockingIOError):
            trap.accept()
    wrong_role = _complete(servers.consumer, "x", kv_transfer_params={"do_remote_decode": True})
    assert wrong_role.status_code == 400
    assert "kv_role is 'consumer', not producer" in wrong_role.json()["error"]["message"]
    servers.producer.wait_idle(timeout=LEASE_SECONDS + 10)  # the unpulled lease expired


def test_unpulled_lease_is_freed_at_expiry(servers: Servers) -> None:
    response = _complete(
        servers.producer, "Nobody will pull this " * 8, kv_transfer_params={"do_remote_decode": True}
    )
    assert response.status_code == 200
    assert servers.producer.stats()["num_used_kv_blocks"] > 0
    before = _metric(servers.producer, contract.M_KV_LEASES_EXPIRED)
    servers.producer.wait_idle(timeout=LEASE_SECONDS + 10)
    wait_for(
        lambda: _metric(servers.producer, contract.M_KV_LEASES_EXPIRED) == before + 1,
        timeout=30,
        message="expiry metric",
    )


def test_release_endpoint_frees_a_lease_before_it_expires(servers: Servers) -> None:
    """What the router calls when a client goes away between the legs: the signed params free
    their lease at once; anything else is a 400 that changes nothing."""
    producer = servers.producer
    expired = _metric(producer, contract.M_KV_LEASES_EXPIRED)
    leg = _complete(producer, "Released early " * 8, kv_transfer_params={"do_remote_decode": True})
    kv = leg.json()["kv_transfer_params"]
    path = contract.PATH_KV_TRANSFER_RELEASE
    cases = [
        (producer, {"kv_transfer_params": {**kv, "transfer_id": "another"}}, "signature: does not match"),
        (producer, {"kv_transfer_params": {"do_remote_decode": True}}, "do_remote_decode: unknown field"),
        (producer, {}, "kv_transfer_params: must be an object"),
        (servers.consumer, {"kv_transfer_params": kv}, "kv_role is 'consumer', not producer"),
    ]
    for server, body, message in cases:
        refused = server.http.post(path, json=body)
        assert refused.status_code == 400, refused.text
        assert message in refused.json()["error"]["message"]
    assert producer.stats()["kv_leases_held"] == 1
    released = producer.http.post(path, json={"kv_transfer_params": kv})
    assert released.status_code == 200
    assert released.json() == {"transfer_id": kv["transfer_id"], "released": True}
    producer.wait_idle(timeout=LEASE_SECONDS)
    again = producer.http.post(path, json={"kv_transfer_params": kv})
    assert again.json() == {"transfer_id": kv["transfer_id"], "released": False}
    assert _metric(producer, contract.M_KV_LEASES_EXPIRED) == expired


def test_params_of_another_kv_key_are_refused_and_recomputed(servers: Servers) -> None:
    """Params from a producer of another KV-compatibility key (a pod of the other generation of a
    rollout, signed by the same deployment key): the consumer pulls nothing, releases the lease,
    recomputes, and answers exactly what one engine answers."""
    prompt = "The longest river in Africa is"
    want = _complete(servers.producer, prompt).json()["choices"][0]["text"]
    expired = _metric(servers.producer, contract.M_KV_LEASES_EXPIRED)
    received = _metric(servers.consumer, contract.M_KV_TRANSFER_BYTES, direction="received")
    kv = _complete(servers.producer, prompt, kv_transfer_params={"do_remote_decode": True}).json()
    params = {k: v for k, v in kv["kv_transfer_params"].items() if k != "signature"}
    other = KVTransferParams.from_dict({**params, "kv_key": "0123456789abcdef"}).signed(KEY).to_dict()

    answer = _complete(servers.consumer, prompt, kv_transfer_params=other)

    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == want
    servers.consumer.wait_idle()
    wait_for(
        lambda: _failures(servers.consumer, "kv_key_mismatch") == 1,
        timeout=30,
        message="one kv_key_mismatch on the consumer",
    )
    assert _metric(servers.consumer, contract.M_KV_TRANSFER_BYTES, direction="received") == received
    servers.producer.wait_idle(timeout=LEASE_SECONDS + 10)
    assert _metric(servers.producer, contract.M_KV_LEASES_EXPIRED) == expired  # released, not expired


def _failures(server: ServerProcess, reason: str) -> float:
    try:
        return _metric(server, contract.M_KV_TRANSFER_FAILURES, reason=reason)
    except AssertionError:  # no sample before the first failure of that reason
        return 0.0


def test_producer_killed_between_the_legs_recomputes(servers: Servers) -> None:
    prompt = "The tallest mountain on Earth is"
    want = _complete(servers.producer, prompt).json()["choices"][0]["text"]
    first = _complete(servers.producer, prompt, kv_transfer_params={"do_remote_decode": True})
    kv = first.json()["kv_transfer_params"]
    core_pid = servers.core_pids[servers.producer.pid]
    servers.producer.stop(signal.SIGKILL, timeout=10)
    wait_for(lambda: not pid_alive(core_pid), timeout=10, message="the producer's core to exit")
    second = _complete(servers.consumer, prompt, kv_transfer_params=kv)
    assert second.status_code == 200
    assert second.json()["choices"][0]["text"] == want
    servers.consumer.wait_idle()
