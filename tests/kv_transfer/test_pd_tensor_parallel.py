"""P/D between pods of different tensor-parallel sizes, through real engines over ZMQ on
127.0.0.1 (a tiny random Llama, 4 attention heads over 2 KV heads, CPU, float32, gloo).

The producer is a `baton-engine serve` process of TP=P (its ranks serve their own heads on their
own ports); the consumer an engine core of TP=D in the test process (its ranks each pull the
heads they need from the producer ranks holding them). The test plays the router: the prefill
leg goes to the producer with ``{"do_remote_decode": true}``, the decode leg to the consumer
with the signed params. Greedy tokens must be a single engine's for every (P, D) of 1, 2 and 4
(4 > 2 KV heads: every head lives on two ranks); every producer block is freed once every rank
ended its lease. A producer whose model has other KV heads is refused at the handshake, naming
them, and the consumer recomputes: its tokens are still the single engine's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.entrypoints.engine_factory import build_engine_core, close_runner
from baton_engine.worker.tp_executor import TensorParallelExecutor
from baton_support.ports import free_port_range
from baton_support.tiny_models import parity_model
from baton_support.wait import wait_for
from tests.kv_transfer.helpers import KEY
from tests.pd_setup import pd_environment
from tests.server.server_process import ServerProcess, child_pids, pid_alive
from tests.torch_threads import one_torch_thread
from tests.worker.tp_helpers import live_children

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# A trained tokenizer in front (the server produces text); prompts are token ids.
MODEL = parity_model("llama", seed=5).replace(dtype="float32", chat_tokenizer=True)
NAME = "tiny"
BLOCK_SIZE = 4
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SETTINGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": BLOCK_SIZE,
    "num_kv_blocks": 64,
    "max_model_len": 256,
    "tensor_parallel_timeout_seconds": 300.0,  # a loaded machine may deschedule a rank for long
}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in (6, 13, 21)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pd-tp")
    paths = {"llama": root / "llama", "four-kv-heads": root / "four-kv-heads"}
    MODEL.save(paths["llama"])
    MODEL.replace(num_kv_heads=4).save(paths["four-kv-heads"])
    return paths


@pytest.fixture(scope="module", autouse=True)
def _environment() -> Iterator[None]:
    with one_torch_thread(), pd_environment(KEY.decode()):
        yield


def _generate(core: EngineCore, name: str, prompt: list[int], kv: dict[str, Any] | None) -> list[int]:
    core.add_request(name, prompt, GREEDY, kv_transfer_params=kv)
    tokens: list[int] = []

    def finished() -> bool:
        done = False
        for out in core.step():
            if out.request_id == name:
                tokens.extend(out.new_token_ids)
                done = done or out.finished
        return done

    wait_for(finished, timeout=300, interval=0, message=f"request {name} to finish")
    return tokens


@pytest.fixture(scope="module")
def single(models: dict[str, Path]) -> list[list[int]]:
    core, _ = build_engine_core(EngineConfig(model=str(models["llama"]), **SETTINGS))
    return [_generate(core, f"single-{i}", p, None) for i, p in enumerate(_prompts())]


@contextlib.contextmanager
def _producer(model: Path, tp: int, log: Path) -> Iterator[ServerProcess]:
    args = [
        "--dtype", "float32", "--served-model-name", NAME, "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "256", "--num-kv-blocks", "64", "--kv-role", "producer",
        "--kv-lease-seconds", "60", "--kv-transfer-port", str(free_port_range(tp)),
        "--tensor-parallel-size", str(tp), "--tensor-parallel-timeout-seconds", "300",
    ]  # fmt: skip
    server = ServerProcess(str(model), *args, log_path=log)
    core_pid = int(server.stats()["core_pid"])
    ranks = child_pids(core_pid)
    assert len(ranks) == tp - 1, ranks
    try:
        yield server
    finally:
        server.stop(signal.SIGTERM, timeout=60)
        for pid in [core_pid, *ranks]:
            wait_for(
                lambda pid=pid: not pid_alive(pid), timeout=30, message=f"producer process {pid} to exit"
            )
        assert "did not stop; killing it" not in server.log_text()  # each rank stopped when told


@contextlib.contextmanager
def _consumer(model: Path, tp: int, **settings: Any) -> Iterator[EngineCore]:
    config = EngineConfig(
        model=str(model), kv_role="consumer", tensor_parallel_size=tp, **(SETTINGS | settings)
    )
    core, _ = build_engine_core(config)
    try:
        yield core
    finally:
        assert core.kv_connector is not None
        core.kv_connector.close()
        close_runner(core)
        if isinstance(core.runner, TensorParallelExecutor):  # each rank stopped when told, none killed
            assert [r.process.returncode for r in core.runner.ranks] == [0] * (tp - 1)


def _prefill(producer: ServerProcess, prompt: list[int]) -> dict[str, Any]:
    body = {
        "model": NAME,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    response = producer.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    kv: dict[str, Any] = response.json()["kv_transfer_params"]
    return kv


def _run_pairs(
    models: dict[str, Path], tmp_path: Path, producer_tp: int, consumer_tps: list[int], want: list[list[int]]
) -> None:
    before = live_children()
    prompts = _prompts()
    with _producer(models["llama"], producer_tp, tmp_path / f"producer-tp{producer_tp}.log") as producer:
        for consumer_tp in consumer_tps:
            with _consumer(models["llama"], consumer_tp) as consumer:
                got = []
                for i, prompt in enumerate(prompts):
                    kv = _prefill(producer, prompt)
                    assert (kv["tp_size"], kv["num_kv_heads"], len(kv["rank_ports"])) == (
                        producer_tp,
                        2,
                        producer_tp if producer_tp > 1 else 0,
                    )
                    got.append(_generate(consumer, f"d{consumer_tp}-{i}", prompt, kv))
                assert got == want, (producer_tp, consumer_tp)
                assert consumer.kv_connector is not None
                totals = consumer.kv_connector.stats.totals().to_dict()
                assert totals["failures"] == {}, totals  # every leg pulled: nothing recomputed
                stats = consumer.stats()
                assert (stats.num_used_kv_blocks, stats.num_running) == (0, 0)
            # Every rank ended its lease (DONE from the consumer's rank 0): all blocks free.
            producer.wait_idle()
            assert producer.stats()["num_used_kv_blocks"] == 0
    assert live_children(before) == []


def test_a_tp1_producer_feeds_tp2_and_tp4_consumers(
    models: dict[str, Path], single: list[list[int]], tmp_path: Path
) -> None:
    _run_pairs(models, tmp_path, 1, [2, 4], single)


def test_a_tp2_producer_feeds_tp1_tp2_and_tp4_consumers(
    models: dict[str, Path], single: list[list[int]], tmp_path: Path
) -> None:
    _run_pairs(models, tmp_path, 2, [1, 2, 4], single)


def test_a_producer_of_other_kv_heads_is_refused_and_the_consumer_recomputes(
    models: dict[str, Path], single: list[list[int]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = live_children()
    caplog.set_level(logging.WARNING, logger="baton_engine.kv_transfer.connector")
    prompts = _prompts()
    with (
        _producer(models["four-kv-heads"], 2, tmp_path / "producer-mha.log") as producer,
        _consumer(models["llama"], 2) as consumer,
    ):
        got = [_generate(consumer, f"r{i}", p, _prefill(producer, p)) for i, p in enumerate(prompts)]
        assert got == single
        assert consumer.kv_connector is not None
        assert consumer.kv_connector.stats.totals().to_dict()["failures"] == {"spec_mismatch": len(prompts)}
    refusal = (
        "failed (spec_mismatch: kv_transfer_params.num_kv_heads: the producer's model has 4 KV heads, "
        "this engine's 2; refusing to pull); recomputing locally"
    )
    assert sum(refusal in r.getMessage() for r in caplog.records) == len(prompts)
    assert live_children(before) == []


def _connections_waiting_on(port: int) -> int:
    """Established TCP connections to 127.0.0.1:`port` with bytes its owner has not read yet
    (/proc/net/tcp: a consumer connected to a stopped producer and is waiting for its reply)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, queues = fields[1], fields[3], fields[4]
        if int(local.split(":")[1], 16) == port and state == "01" and int(queues.split(":")[1], 16) > 0:
            count += 1
    return count


@contextlib.contextmanager
def _stopped(pids: list[int]) -> Iterator[None]:
    """The processes `pids` stopped (SIGSTOP) inside the block, continued after it."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _drain(core: EngineCore, name: str) -> list[Any]:
    """Step `core` until nothing is left; the outputs of request `name`."""
    outputs: list[Any] = []

    def idle() -> bool:
        outputs.extend(out for out in core.step() if out.request_id == name)
        return not core.has_unfinished()

    wait_for(idle, timeout=300, interval=0, message=f"{name} and its pulls to end")
    return outputs


@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(1, 2), (2, 1)])
def test_an_abort_while_the_head_slice_pulls_are_in_flight_leaks_nothing(
    models: dict[str, Path], single: list[list[int]], tmp_path: Path, producer_tp: int, consumer_tp: int
) -> None:
    before = live_children()
    prompts = _prompts()
    log = tmp_path / "producer.log"
    with (
        _producer(models["llama"], producer_tp, log) as producer,
        _consumer(models["llama"], consumer_tp) as consumer,
    ):
        connector = consumer.kv_connector
        assert connector is not None
        kv = _prefill(producer, prompts[2])  # 21 tokens: 6 blocks leased on every producer rank
        assert (producer.stats()["kv_leases_held"], producer.stats()["num_used_kv_blocks"]) == (1, 6)
        core_pid = int(producer.stats()["core_pid"])
        serving = [core_pid, *child_pids(core_pid)]
        first_port = kv["port"]
        with _stopped(serving):  # the producer cannot answer: every pull waits for its reply
            consumer.add_request("aborted", prompts[2], GREEDY, kv_transfer_params=kv)
            wait_for(
                lambda: consumer.step() is not None and _connections_waiting_on(first_port) == consumer_tp,
                timeout=60,
                message="every consumer rank to be pulling from the producer's rank 0",
            )
            assert connector.busy()
            consumer.abort_requests(["aborted"], "client gone")
            consumer.step()
            assert connector.busy()  # the blocks stay allocated until every part has stopped
        outputs = _drain(consumer, "aborted")
        assert [(o.finished, o.finish_reason, o.new_token_ids) for o in outputs] == [(True, "abort", [])]
        stats = consumer.stats()
        assert (stats.num_used_kv_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)
        assert consumer.scheduler.kv_cache_manager.num_free_blocks == SETTINGS["num_kv_blocks"]
        assert connector.stats.totals().to_dict()["failures"] == {"cancelled": 1}
        # The producer heard RELEASE on every rank: no lease left, every block free.
        producer.wait_idle()
        assert (producer.stats()["kv_leases_held"], producer.stats()["num_used_kv_blocks"]) == (0, 0)
        # The consumer serves the next request from a fresh pull, tokens as a single engine's.
        assert _generate(consumer, "next", prompts[0], _prefill(producer, prompts[0])) == single[0]
        assert connector.stats.totals().to_dict()["failures"] == {"cancelled": 1}
        producer.wait_idle()
        assert (producer.stats()["kv_leases_held"], producer.stats()["num_used_kv_blocks"]) == (0, 0)
    assert live_children(before) == []


@pytest.mark.parametrize("on_failure", ["recompute", "fail"])
def test_a_producer_gone_before_the_pulls_means_a_recompute_or_a_clean_error(
    models: dict[str, Path], single: list[list[int]], tmp_path: Path, on_failure: str
) -> None:
    """A TP=2 producer whose rank 1 is killed ends (its core exits, the server with code 1);
    the TP=2 consumer's pulls of a request it had leased find nobody listening on any rank.
    The consumer recomputes (the single engine's tokens) or, with ``fail``, finishes the request
    with the reason; every block freed either way."""
    before = live_children()
    prompts = _prompts()
    with _consumer(models["llama"], 2, kv_transfer_on_failure=on_failure) as consumer:
        connector = consumer.kv_connector
        assert connector is not None
        with _producer(models["llama"], 2, tmp_path / "producer.log") as producer:
            kv = _prefill(producer, prompts[1])
            core_pid = int(producer.stats()["core_pid"])
            (rank1,) = child_pids(core_pid)
            os.kill(rank1, signal.SIGKILL)
            assert producer.proc.wait(60) == 1
            assert f"tensor-parallel rank 1 (pid {rank1}) exited with code -9" in producer.log_text()
        assert not pid_alive(core_pid) and not pid_alive(rank1)
        if on_failure == "recompute":
            assert _generate(consumer, "orphaned", prompts[1], kv) == single[1]
        else:
            consumer.add_request("orphaned", prompts[1], GREEDY, kv_transfer_params=kv)
            (out,) = _drain(consumer, "orphaned")
            assert (out.finished, out.finish_reason, out.new_token_ids) == (True, "abort", [])
            reason = "KV transfer from the prefill engine failed: producer_unreachable: cannot connect to "
            assert out.finish_message in {
                f"{reason}tcp://127.0.0.1:{port} (refused)" for port in kv["rank_ports"]
            }
        assert connector.stats.totals().to_dict()["failures"] == {"producer_unreachable": 1}
        stats = consumer.stats()
        assert (stats.num_used_kv_blocks, stats.num_running) == (0, 0)
        assert consumer.scheduler.kv_cache_manager.num_free_blocks == SETTINGS["num_kv_blocks"]
    assert live_children(before) == []
