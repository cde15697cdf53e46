"""bench.pd: the flags its servers get (the operator's), its load and figures (exact values), its
refusals, and that every process it starts is gone after a failed start and after Ctrl-C."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from baton_support.wait import wait_for
from bench import pd
from bench.pd import (
    CPU_QUICK,
    Fleet,
    Record,
    Settings,
    engine_launches,
    make_load,
    router_argv,
    summarize,
    verdict,
)

REPO = Path(__file__).resolve().parents[2]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_engines_get_the_operators_role_flags_on_loopback() -> None:
    pd_engines = engine_launches("disaggregated", CPU_QUICK, Path("/models/m"), 288)
    agg_engines = engine_launches("aggregated", CPU_QUICK, Path("/models/m"), 288)
    assert [(e.name, e.role, flag(e.argv, "--kv-role")) for e in pd_engines + agg_engines] == [
        ("prefill0", "prefill", "producer"),
        ("decode1", "decode", "consumer"),
        ("engine0", "engine", "both"),
        ("engine1", "engine", "both"),
    ]
    for e in pd_engines + agg_engines:
        assert flag(e.argv, "--model") == "/models/m"
        assert flag(e.argv, "--host") == "127.0.0.1"
        assert flag(e.argv, "--port") == str(e.port)
        assert (flag(e.argv, "--max-model-len"), flag(e.argv, "--num-kv-blocks")) == ("288", "128")
        assert flag(e.argv, "--max-num-batched-tokens") == "2048"
        assert flag(e.argv, "--kv-events-port") == str(e.kv_events_port)
        assert e.gpu is None
    ports = [
        int(flag(e.argv, f)) for e in pd_engines for f in ("--port", "--kv-transfer-port", "--kv-events-port")
    ]
    assert len(set(ports)) == 6  # two servers on one host: no shared port
    # Producer and consumer of one deployment share its KV-compatibility key.
    assert len({flag(e.argv, "--kv-compat-key") for e in pd_engines}) == 1


def test_router_gets_static_discovery_of_its_layout() -> None:
    engines = engine_launches("disaggregated", CPU_QUICK, Path("/m"), 288)
    args = router_argv("disaggregated", CPU_QUICK, Path("/m"), engines, 9999)
    prefill, decode = engines
    assert args == [
        "--mode", "disaggregated", "--model", "pd-bench", "--tokenizer", "/m",
        "--host", "127.0.0.1", "--port", "9999", "--hold-queue", "64", "--hold-timeout", "120",
        "--kv-events", "--discovery", "static",
        "--prefill", f"http://127.0.0.1:{prefill.port}#kv-events={prefill.kv_events_port},kv-replay={prefill.kv_replay_port}",
        "--decode", f"http://127.0.0.1:{decode.port}#kv-events={decode.kv_events_port},kv-replay={decode.kv_replay_port}",
        "--block-size", "16", "--prefix-hash", "fast",
    ]  # fmt: skip
    agg = engine_launches("aggregated", CPU_QUICK, Path("/m"), 288)
    args = router_argv("aggregated", CPU_QUICK, Path("/m"), agg, 9999)
    assert flag(args, "--mode") == "aggregated"
    assert args[args.index("--engine") + 1 : args.index("--engine") + 3] == [e.router_url for e in agg]
    assert "--prefill" not in args and "--namespace" not in args


def test_gpu_engines_are_pinned_one_per_gpu_or_share_gpu_0() -> None:
    gpu = dataclasses.replace(pd.GPU, num_kv_blocks=1000)
    assert [e.gpu for e in engine_launches("disaggregated", gpu, Path("/m"), 8448)] == ["0", "1"]
    shared = dataclasses.replace(gpu, share_gpu=True)
    assert [e.gpu for e in engine_launches("aggregated", shared, Path("/m"), 8448)] == ["0", "0"]
    e = engine_launches("disaggregated", pd.GPU, Path("/m"), 8448)[0]
    assert flag(e.argv, "--device") == "cuda" and "--num-kv-blocks" not in e.argv


def test_load_is_seeded_poisson_within_the_prompt_range() -> None:
    settings = dataclasses.replace(CPU_QUICK, duration_s=50.0, prompt_tokens=(10, 20))
    a, b = make_load(4.0, 0, settings, 512), make_load(4.0, 0, settings, 512)
    assert a == b  # every layout gets the same requests
    assert 160 <= len(a.prompts) <= 240 and a.arrivals_s[0] == 0.0  # 4/s x 50 s on average
    assert all(x < y for x, y in zip(a.arrivals_s, a.arrivals_s[1:], strict=False))
    assert a.arrivals_s[-1] < 50.0
    assert {len(p) for p in a.prompts} <= set(range(10, 21))
    assert min(min(p) for p in a.prompts) >= 1 and max(max(p) for p in a.prompts) < 512
    mean_gap = a.arrivals_s[-1] / (len(a.arrivals_s) - 1)
    assert 0.2 < mean_gap < 0.3  # 1 / rate = 0.25 s
    assert make_load(4.0, 1, settings, 512).prompts != a.prompts  # another rate, other prompts


def test_figures_and_goodput_exact() -> None:
    settings = Settings(output_tokens=3, slo_ttft_s=1.0, slo_itl_ms=100.0)
    records = [
        Record(10, 0.0, ttft_s=0.5, gaps_s=[0.05, 0.05], chunks=3, streamed=3, tokens=3, done_at=0.6),
        Record(20, 0.0, ttft_s=2.0, gaps_s=[0.05, 0.0], chunks=2, streamed=3, tokens=3, done_at=2.05),  # TTFT
        Record(30, 0.0, ttft_s=0.1, gaps_s=[0.3, 0.0], chunks=2, streamed=3, tokens=3, done_at=0.4),  # TPOT
        Record(40, 0.0, error="HTTP 503: b'busy'"),
    ]
    figures = summarize(records, 3.0, settings)
    late = summarize(records, 30.0, settings)  # the last answer came 15 s after the arrivals ended
    assert (late["window_s"], late["output_tokens_per_s"], late["goodput_rps"]) == (30.0, 0.3, 0.0333)
    assert figures == {
        "requests": 4,
        "arrived_rps": 0.267,  # 4 requests over the default 15 s
        "completed": 3,
        "errors": 1,
        "error_samples": ["HTTP 503: b'busy'"],
        "ttft_p50_s": 0.5,
        "ttft_p99_s": 1.97,
        "itl_p50_ms": 50.0,
        "itl_p99_ms": 287.5,
        "output_tokens_per_s": 0.6,  # 9 tokens over the 15 s window (the answers came within it)
        "offered_output_tokens_per_s": 0.8,  # 4 requests x 3 tokens over 15 s
        "goodput_fraction": 0.25,
        "goodput_rps": 0.0667,
        "tokens_per_chunk": 1.286,
        "mean_prompt_tokens": 25.0,
        "wall_s": 3.0,
        "window_s": 15.0,
    }


def test_verdict_names_the_winner_of_each_figure() -> None:
    pd_figures = {"ttft_p50_s": 1.5, "ttft_p99_s": 3.0, "itl_p50_ms": 10.0, "itl_p99_ms": 20.0,
                  "output_tokens_per_s": 100.0, "goodput_fraction": 0.9}  # fmt: skip
    agg_figures = {"ttft_p50_s": 1.0, "ttft_p99_s": 2.9, "itl_p50_ms": 20.0, "itl_p99_ms": 80.0,
                   "output_tokens_per_s": 100.0, "goodput_fraction": 0.5}  # fmt: skip
    v = verdict(pd_figures, agg_figures)
    assert v["winners"] == {
        "ttft_p50_s": "aggregated",
        "ttft_p99_s": "tie",  # 3.0 vs 2.9: within 5 %
        "itl_p50_ms": "disaggregated",
        "itl_p99_ms": "disaggregated",
        "output_tokens_per_s": "tie",
        "goodput_fraction": "disaggregated",
    }
    assert v["ratio_pd_over_aggregated"]["itl_p99_ms"] == 0.25
    assert v["summary"] == (
        "P/D wins itl_p50_ms (0.5x), itl_p99_ms (0.25x), goodput_fraction (1.8x); "
        "aggregated wins ttft_p50_s (1.5x) (ratios P/D / aggregated)"
    )
    assert verdict({**pd_figures, "ttft_p50_s": None}, agg_figures)["winners"]["ttft_p50_s"] is None


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.pd", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rates", "1,x"], "--rates: '1,x' is not a comma-separated list of numbers"),
        (["--rates", "0"], "--rates: every rate must be > 0"),
        (["--prompt-tokens", "9,3"], "--prompt-tokens: need 1 <= MIN <= MAX, got '9,3'"),
        (["--layouts", "hybrid"], "--layouts: ['hybrid'] not in disaggregated, aggregated"),
        (["--share-gpu"], "--share-gpu: only with --device cuda"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        pd.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_refuses_fewer_than_two_gpus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(pd, "gpu_count", lambda: 1)
    with pytest.raises(SystemExit) as exit_info:
        pd.main(["--device", "cuda", "--json"])
    assert exit_info.value.code == 2
    assert (
        "--device cuda needs 2 GPUs (one per engine), this machine has 1; "
        "--share-gpu runs both engines on GPU 0" in capsys.readouterr().err
    )
    monkeypatch.setattr(pd, "gpu_count", lambda: 0)
    with pytest.raises(SystemExit):
        pd.main(["--device", "cuda", "--share-gpu"])
    assert "--device cuda --share-gpu: no GPU visible" in capsys.readouterr().err


# -- processes ---------------------------------------------------------------------------------------


def descendants(roots: list[int]) -> set[int]:
    table = pd.process_table()
    found = set(roots) & set(table)
    while True:
        more = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
        if not more:
            return found
        found |= more


def alive(pids: set[int]) -> set[int]:
    return pids & set(pd.process_table())


class SnapshotFleet(Fleet):
    """The bench's fleet; before stopping, it notes every process under each started one."""

    seen: set[int]

    def spawn(self, name: str, argv: list[str], env: dict[str, str], url: str) -> pd.Started:
        started = super().spawn(name, argv, env, url)
        self.spawned = [*getattr(self, "spawned", []), (name, started.process.pid)]
        return started

    def stop_all(self) -> None:
        self.seen = getattr(self, "seen", set()) | descendants(self.pids)
        super().stop_all()


@pytest.mark.slow
def test_an_engine_that_fails_to_start_leaves_no_process(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    vocab = pd.build_cpu_model(model)
    assert vocab == 512
    engines = engine_launches("disaggregated", CPU_QUICK, model, 288)
    engines[1].argv[engines[1].argv.index("--num-kv-blocks") + 1] = "0"  # the decode engine refuses it
    fleet = SnapshotFleet(tmp_path)
    with (
        pytest.raises(RuntimeError) as error,
        pd.deployment("disaggregated", CPU_QUICK, model, engines, fleet),
    ):
        raise AssertionError("the deployment started")
    assert "decode1 exited with 2 before it was ready" in str(error.value)
    assert "--num-kv-blocks: Input should be greater than or equal to 1" in str(error.value)
    # The prefill engine was up, with its engine core: both stopped, and nothing else is left.
    (prefill, prefill_pid), (decode, decode_pid) = fleet.spawned
    assert (prefill, decode) == ("prefill0", "decode1")
    assert decode_pid not in fleet.seen  # it had exited
    assert prefill_pid in fleet.seen and len(fleet.seen - {prefill_pid}) >= 1, fleet.seen  # + its core
    assert alive(fleet.seen | {decode_pid}) == set()
    assert fleet.started == []


@pytest.mark.slow
def test_ctrl_c_stops_every_process_it_started() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.pd", "--quick", "--json"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    seen: set[int] = set()
    try:

        def router_up() -> bool:
            assert process.poll() is None, "".join(lines)
            started = [int(line.split("(pid ")[1].split(",")[0]) for line in lines if "] started " in line]
            seen.update(descendants(started))
            return any("disaggregated: rate" in line for line in lines)

        wait_for(router_up, timeout=240, interval=0.2, message="bench.pd to send its first rate")
        assert len(seen) >= 5, (seen, lines)  # two servers with their cores, the router
        os.kill(process.pid, signal.SIGINT)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    reader.join(timeout=10)
    assert process.returncode != 0
    assert "KeyboardInterrupt" in "".join(lines)
    assert alive(seen) == set()


def test_the_gpu_model_folder_loads_and_serves_words(tmp_path: Path) -> None:
    """The writer of the 8B folder, on bench.gpu's tiny config on the CPU: the engine loads it,
    generates, and each generated token is one word of the word-level tokenizer."""
    from baton_engine import LLM, SamplingParams
    from bench.gpu import TINY

    assert pd.write_random_model(tmp_path, TINY, "float32", "cpu") == TINY.vocab_size == 1000
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=128)
    [result] = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    [out] = result.outputs
    assert len(out.token_ids) == 6
    assert out.text.split() == [f"w{i}" for i in out.token_ids]


def test_a_failed_layout_is_reported_and_the_other_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[str] = []

    def run_layout(layout: str, settings: Settings, *rest: object) -> dict[str, dict[str, object]]:
        ran.append(layout)
        if layout == "disaggregated":
            raise RuntimeError("decode1 exited with 1 before it was ready")
        return {"2": {"completed": 6}}

    monkeypatch.setattr(pd, "run_layout", run_layout)
    monkeypatch.setattr(pd, "build_cpu_model", lambda directory: 512)
    rates, failed = pd.run(CPU_QUICK, tmp_path, Fleet(tmp_path))
    assert ran == ["disaggregated", "aggregated"]
    assert failed == {"disaggregated": "RuntimeError: decode1 exited with 1 before it was ready"}
    assert rates == {"2": {"aggregated": {"completed": 6}}}  # no verdict without both layouts


def test_table_of_a_recorded_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    figures = {"requests": 43, "completed": 42, "errors": 1, "ttft_p50_s": 0.0173, "ttft_p99_s": None,
               "itl_p50_ms": 0.9537, "itl_p99_ms": 15.7754, "output_tokens_per_s": 93.33,
               "offered_output_tokens_per_s": 91.73, "goodput_fraction": 1.0, "goodput_rps": 2.9}  # fmt: skip
    result = {
        "rates": {"2": {"disaggregated": figures, "aggregated": figures, "verdict": {"summary": "tie"}}}
    }
    recorded = tmp_path / "run.log"
    recorded.write_text("[pd] progress\n" + json.dumps(result) + "\n")
    assert pd.main(["--table", str(recorded)]) == 0
    row = "| 42 / 43 (1) | 0.0173 / — | 0.9537 / 15.7754 | 93.33 (91.73) | 1 (2.9) |"
    assert capsys.readouterr().out.splitlines() == [
        "| rate (req/s) | layout | completed / sent (errors) | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) "
        "| output tok/s (offered) | goodput fraction (req/s) |",
        "|---|---|---|---|---|---|---|",
        f"| 2 | disaggregated {row}",
        f"| 2 | aggregated {row}",
        "| 2 | verdict | tie | | | | |",
    ]
    (tmp_path / "empty").write_text("")
    with pytest.raises(SystemExit):
        pd.main(["--table", str(tmp_path / "empty")])
    assert f"--table: '{tmp_path / 'empty'}' does not end with a JSON line" in capsys.readouterr().err
