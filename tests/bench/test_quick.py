"""Every benchmark keeps running: each one's ``--quick`` mode (seconds, tiny shapes, the whole
path) as a user would start it, ``python -m bench.<name> --quick --json``, its last line parsed as
JSON and its figures checked. GPU-only benchmarks are at least imported and argument-parsed here;
the attention kernels run through Triton's interpreter when there is no GPU. Benchmarks that need
a cluster share the session's local cluster (`dev_cluster`) where they can."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from baton_dev.testing import DevCluster
from baton_support.apiserver import binary_dir
from bench.pd import VERDICT_FIGURES

REPO = Path(__file__).resolve().parents[2]
GPU_PRESENT = os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")


@dataclass(frozen=True)
class Bench:
    keys: tuple[str, ...]
    """Keys the JSON line must carry (besides ``bench`` and ``quick``)."""
    cluster: str = ""
    """"apiserver": needs the etcd/kube-apiserver binaries; "dev_cluster": runs on the session's
    local cluster (``--cluster-dir``); "own": starts and stops clusters itself (what it measures)."""
    gpu_only: bool = False
    """Runs only on a GPU: here it is imported and its arguments parsed (``--help``)."""
    smoke_test: str = ""
    """A test elsewhere that already runs exactly this benchmark's quick configuration (in
    process); here the CLI is only argument-parsed, so the suite does not run it twice."""
    extra_args: tuple[str, ...] = field(default=())


#: Every benchmark under bench/ (a module or a package with __main__).
BENCHMARKS: dict[str, Bench] = {
    "scheduler": Bench(("us_per_seq_step", "cpu_us_per_seq_step", "mixed", "config")),
    "kv_transfer": Bench(("cases", "ratio_vs_raw_tcp", "ratio_vs_raw_tcp_median")),
    "router": Bench(("added_latency_ms_p50", "router_cpu_us_per_chunk", "samples_router")),
    "cpu_throughput": Bench(("baton_tokens_per_s", "hf_tokens_per_s", "ratio", "ratio_cpu_time")),
    "speculative": Bench(("acceptance_rate", "speedup_cpu", "outputs_identical", "speedup_gpu_projected")),
    "attention_kernels": Bench(("us", "splits", "digest")),
    "autoscaler": Bench(("decide_cpu_us", "parse_cpu_us_per_pod", "reaction_s"), cluster="apiserver"),
    "cluster": Bench(("warm_up_s", "down_s"), cluster="own"),
    "operator": Bench(
        ("apply_to_children_p99_s", "reconcile_4_s", "operator_rss_mb", "api_requests_per_resource"),
        cluster="dev_cluster",
    ),
    "grammar_mask": Bench(("llguidance", "xgrammar", "apply", "vocab_size")),
    "tp": Bench(("sizes", "speedup", "ideal_speedup", "tokens_identical", "skipped_sizes")),
    "soak": Bench(
        ("requests", "unexpected", "end", "rss_mib"),
        smoke_test="tests/server/test_soak.py::test_short_soak_leaks_no_block_and_leaves_no_request_stuck",
    ),
    "cold_start": Bench(
        ("cold_start_s", "woken_after_s", "ready_after_s", "engine_floor_s", "orchestration_s"),
        smoke_test="tests/rollout_e2e/test_scale_to_zero_e2e.py::"
        "test_idle_to_zero_a_request_wakes_both_pools_and_a_burst_beyond_the_queue_gets_503",
    ),
    "amd_compile": Bench(
        ("summary", "kernels", "failures", "cost"),
        smoke_test="tests/kernel_targets/test_compile_targets.py::test_bench_amd_compile_reports_the_test_run",
    ),
    # vLLM's start alone takes minutes on a loaded 2-core machine: the smoke run measures Baton
    # only (its full run compares both sides).
    "serving": Bench(("serving", "offline", "notes", "load_average_1m"), extra_args=("--skip-vllm",)),
    "pd": Bench(("rates", "figure", "slo", "config")),
    "gpu": Bench(("engine_vs_sweep",), gpu_only=True),
    "gpu_tune": Bench(("decode_1b_b8_ctx128",), gpu_only=True),
}
#: Modules under bench/ that are not benchmarks of their own.
HELPERS = {
    "shapes": "model shapes the GPU benchmarks share",
    "limits": "the physical limits bench.gpu compares its steps with (pure arithmetic)",
    "gpu_moe": "bench.gpu's moe section (Qwen3-30B-A3B shape)",
    "gpu_fp8": "bench.gpu's fp8 section (8B shape, FP8 weights vs bf16)",
    "router_upstream": "the fixed-rate upstream that bench.router starts",
    "operator_load": "the code of bench.operator",
    "autoscaler_reaction": "the operator-process part of bench.autoscaler",
    "plots": "draws docs/img/*.png from the recorded figures",
    "vllm_offline": "the vLLM side of bench.serving's offline run (run by the vLLM venv's python)",
}


def bench_modules() -> set[str]:
    folder = REPO / "bench"
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    return modules | {p.parent.name for p in folder.glob("*/__main__.py")}


def test_every_benchmark_has_a_smoke_run() -> None:
    unlisted = sorted(bench_modules() - set(BENCHMARKS) - set(HELPERS))
    assert unlisted == [], f"add {unlisted} to BENCHMARKS (with its --quick keys) or HELPERS in {__file__}"
    assert sorted(set(BENCHMARKS) | set(HELPERS)) == sorted(bench_modules())


def run_in_own_group(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run a benchmark in its own process group; past the deadline the whole group is killed, so
    no server or child process a benchmark started outlives it."""
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{argv[2]} ran past {timeout_s} s:\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def run_quick(name: str, *args: str, timeout_s: float = 600) -> tuple[dict[str, Any], str]:
    """The benchmark's last stdout line as JSON, and its stderr."""
    done = run_in_own_group([sys.executable, "-m", f"bench.{name}", "--quick", "--json", *args], timeout_s)
    assert done.returncode == 0, f"bench.{name} --quick exited {done.returncode}:\n{done.stderr[-4000:]}"
    last = done.stdout.strip().splitlines()[-1]
    result: dict[str, Any] = json.loads(last)
    assert result["bench"] == name
    assert result["quick"] is True
    missing = [k for k in BENCHMARKS[name].keys if k not in result]
    assert missing == [], f"bench.{name} --quick lacks {missing}"
    return result, done.stderr


CPU_BENCHES = [n for n, b in BENCHMARKS.items() if not b.gpu_only and not b.cluster and not b.smoke_test]


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_BENCHES)
def test_cpu_benchmark_quick(name: str) -> None:
    result, stderr = run_quick(name, *BENCHMARKS[name].extra_args)
    check = CHECKS.get(name)
    if check is not None:
        check(result, stderr)


def _scheduler(r: dict[str, Any], stderr: str) -> None:
    assert sorted(r["us_per_seq_step"]) == ["16", "64"]
    assert sorted(r["mixed"]["cpu_us_per_seq_step"]) == ["16", "64"]
    assert r["config"]["repeats"] == 2
    assert all(v > 0 for v in r["cpu_us_per_seq_step"].values())


def _kv_transfer(r: dict[str, Any], stderr: str) -> None:
    (case,) = r["cases"].values()
    assert case["blocks"] == 16
    assert case["bytes"] == 16 * 30 * 2 * 16 * 3 * 64 * 4  # blocks x layers x K/V x tokens x heads x dim x 4
    assert r["ratio_vs_raw_tcp"] == case["ratio"] > 0


def _router(r: dict[str, Any], stderr: str) -> None:
    assert (r["streams"], r["chunks_per_stream"], r["rounds"]) == (4, 20, 1)
    assert r["samples_direct"] == r["samples_router"] == 4 * 20
    assert r["failed_streams_direct"] == r["failed_streams_router"] == 0


def _cpu_throughput(r: dict[str, Any], stderr: str) -> None:
    assert r["num_prompts"] == 6
    assert 6 * 4 <= r["requested_tokens"] <= 6 * 12
    assert r["baton_tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0
    # The full run takes minutes: it says what it is doing (on stderr, the JSON stays last).
    assert "Baton: 6 prompts at once" in stderr and "Baton: done in" in stderr
    assert "transformers: batch 2/2 done" in stderr


def _speculative(r: dict[str, Any], stderr: str) -> None:
    assert (r["num_prompts"], r["max_tokens"], r["k"]) == (2, 16, 4)
    assert r["outputs_identical"] is True
    assert 2 <= r["generated_tokens"] <= 2 * 16  # EOS may end a request early
    assert (r["gpu_shape"], r["gpu_batch_size"], r["gpu_context"]) == ("tiny-shape", 2, 32)
    assert sorted(r["verify_ms_by_k"], key=int) == [str(k) for k in range(9)]
    assert r["speedup_gpu_projected"] > 0


def _grammar_mask(r: dict[str, Any], stderr: str) -> None:
    assert r["batch"] == 8
    assert r["llguidance"]["mask_us_per_row_token"] > 0 and r["xgrammar"]["mask_us_per_row_token"] > 0


def _tp(r: dict[str, Any], stderr: str) -> None:
    assert sorted(r["sizes"]) == ["1", "2"] and r["skipped_sizes"] == []
    assert r["tokens_identical"] is True  # a split model gives one rank's tokens
    assert r["speedup"] > 0 and 1 <= r["ideal_speedup"] <= 2
    assert sorted(r["sizes"]["2"]["rank_rss_mib"]) == ["0", "1"]  # both ranks measured
    assert r["sizes"]["1"]["steps"] == r["sizes"]["2"]["steps"] > 0  # the same scheduler decisions


def _attention_kernels(r: dict[str, Any], stderr: str) -> None:
    assert sorted(r["us"]) == ["decode_1b_b1_ctx40", "mq_1b_b1_q2_ctx40", "prefill_1b_1x24"]
    assert r["splits"]["prefill_1b_1x24"] == 1
    assert all(len(d) == 16 for d in r["digest"].values())


def _serving(r: dict[str, Any], stderr: str) -> None:
    assert r["notes"]["vllm"] == "skipped: --skip-vllm"
    assert "ratios" not in r and list(r["offline"]) == ["baton"]
    (offline,) = r["offline"]["baton"]["4"]["rounds"]
    assert offline["tokens_per_s"] > 0 and offline["cpu_ms_per_output_token"] > 0
    if "serving" in r["notes"]:  # aiperf's venv is not built on this machine
        assert r["notes"]["serving"].startswith("skipped: aiperf absent:"), r["notes"]
        assert r["serving"] == {"baton": {}}
        return
    level = r["serving"]["baton"]["2"]
    assert (level["completed"], level["errors"]) == (4, 0)
    assert level["output_tokens_per_s"] > 0 and level["ttft_p50_ms"] > 0 and level["itl_p50_ms"] > 0
    # The server's own prefix-cache counters were read (None only when nothing was looked up),
    # and aiperf's process tree used CPU of its own while it ran.
    assert 0 <= level["prefix_cache_hit_rate"] <= 1
    assert level["load_generator_cpu_cores"] > 0


def _pd(r: dict[str, Any], stderr: str) -> None:
    assert r["figure"].startswith("CPU-only shape check")
    assert r["failed_layouts"] == {}
    (rate,) = r["rates"].values()
    assert sorted(rate) == ["aggregated", "disaggregated", "verdict"]
    for layout in ("aggregated", "disaggregated"):
        figures = rate[layout]
        assert (figures["requests"], figures["completed"], figures["errors"]) == (
            6,
            6,
            0,
        )  # seeded Poisson, 2 s at 2/s
        assert figures["ttft_p50_s"] > 0 and figures["itl_p99_ms"] > 0 and figures["output_tokens_per_s"] > 0
        assert 0 <= figures["goodput_fraction"] <= 1
        assert figures["router_fallbacks"] == 0
    # The decode engine pulled every prompt's KV from the prefill engine (none recomputed).
    pd_figures = rate["disaggregated"]
    assert pd_figures["kv_transfer_bytes"] > 0
    assert pd_figures["kv_transfer_failures"] == pd_figures["kv_leases_expired"] == 0
    assert sorted(rate["verdict"]["winners"]) == sorted(name for name, _ in VERDICT_FIGURES)


CHECKS: dict[str, Callable[[dict[str, Any], str], None]] = {
    "pd": _pd,
    "scheduler": _scheduler,
    "kv_transfer": _kv_transfer,
    "router": _router,
    "cpu_throughput": _cpu_throughput,
    "speculative": _speculative,
    "attention_kernels": _attention_kernels,
    "grammar_mask": _grammar_mask,
    "tp": _tp,
    "serving": _serving,
}


@pytest.mark.parametrize("name", [n for n, b in BENCHMARKS.items() if b.gpu_only or b.smoke_test])
def test_benchmark_parses_its_arguments(name: str) -> None:
    """GPU benchmarks cannot run without a GPU, and those with a smoke test elsewhere already ran
    there: their imports and argument parsing still must work here."""
    if BENCHMARKS[name].smoke_test:
        path, test = BENCHMARKS[name].smoke_test.split("::")
        assert f"def {test}(" in (REPO / path).read_text(), BENCHMARKS[name].smoke_test
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "--quick" in done.stdout and "--json" in done.stdout


@pytest.mark.k8s
@pytest.mark.slow
def test_autoscaler_quick() -> None:
    if binary_dir() is None:
        pytest.skip("etcd/kube-apiserver not built yet (bash devcluster/scripts/build.sh)")
    r, _ = run_quick("autoscaler")
    assert r["reaction_trials"] == 2
    assert 0 < r["reaction_s"] <= 30  # each trial waits at most 30 s for the patch
    assert r["decision_reaction_s_max"] == r["decision_reaction_s_mean"]  # one trial


@pytest.mark.k8s
@pytest.mark.slow
def test_cluster_quick() -> None:
    if binary_dir() is None:
        pytest.skip("Kubernetes binaries not built yet (bash devcluster/scripts/build.sh)")
    r, _ = run_quick("cluster")
    assert (r["kwok_nodes"], r["process_nodes"], len(r["warm_up_runs_s"])) == (1, 1, 1)


@pytest.mark.k8s
@pytest.mark.slow
def test_operator_quick_on_the_session_cluster(dev_cluster: DevCluster) -> None:
    r, _ = run_quick("operator", "--cluster-dir", str(dev_cluster.state.directory))
    assert (r["resources_sequential"], r["resources_burst"], r["children_per_resource"]) == (2, 4, 14)
    assert r["burst_pods_running_12_s"] > 0
    # The bench undid its work on the shared cluster: its namespaces and the operator are gone.
    names = {n["metadata"]["name"] for n in dev_cluster.admin.get("/api/v1/namespaces")["items"]}
    assert {"bench-operator-seq", "bench-operator-burst"} & names == set()
    assert dev_cluster.admin.get("/apis/apps/v1/namespaces/baton-system/deployments")["items"] == []
