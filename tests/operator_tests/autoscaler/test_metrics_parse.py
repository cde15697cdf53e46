"""Parsing an engine's /metrics (real text exposition from a real prometheus_client registry)."""

from __future__ import annotations

import pytest

from baton_engine import contract
from baton_operator.autoscaler.metrics import MetricsParseError, metrics_url, parse_engine_metrics
from baton_operator.autoscaler.policy_types import EngineLoad

from .exposition import QUEUED_TOKENS, engine_exposition


def test_parses_the_load_figures() -> None:
    load = parse_engine_metrics(engine_exposition(waiting=3, running=5, kv_usage=0.42))
    assert load == EngineLoad(
        waiting=3.0,
        running=5.0,
        kv_usage=0.42,
        queued_prompt_tokens=None,
        kv_blocks=1024.0,
        preemptions_total=7.0,
    )


def test_counts_sum_over_label_sets_and_usage_takes_the_fullest() -> None:
    text = engine_exposition(waiting=2, running=1, kv_usage=0.5, models=("a", "b"))
    load = parse_engine_metrics(text)
    assert (load.waiting, load.running, load.kv_usage, load.kv_blocks) == (4.0, 2.0, 0.6, 2048.0)


def test_queued_prompt_tokens_when_named_and_exported() -> None:
    text = engine_exposition(queued_tokens=4096)
    assert parse_engine_metrics(text, queued_tokens_metric=QUEUED_TOKENS).queued_prompt_tokens == 4096.0
    assert parse_engine_metrics(text).queued_prompt_tokens is None
    assert (
        parse_engine_metrics(engine_exposition(), queued_tokens_metric=QUEUED_TOKENS).queued_prompt_tokens
        is None
    )


@pytest.mark.parametrize(
    "missing", [contract.M_REQUESTS_WAITING, contract.M_REQUESTS_RUNNING, contract.M_KV_USAGE]
)
def test_a_missing_required_metric_is_named(missing: str) -> None:
    with pytest.raises(MetricsParseError) as info:
        parse_engine_metrics(engine_exposition(omit=(missing,)))
    vllm = contract.VLLM_EQUIVALENT[missing]
    assert str(info.value) == f"{missing}: missing from /metrics (and {vllm})"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"{contract.M_KV_USAGE} 1.5\n", f"{contract.M_KV_USAGE}: 1.5 is not a ratio in 0..1"),
        (f"{contract.M_KV_USAGE} NaN\n", f"{contract.M_KV_USAGE}: bad value nan"),
        (
            f"{contract.M_KV_USAGE} 0.5\n{contract.M_REQUESTS_WAITING} -2\n{contract.M_REQUESTS_RUNNING} 0\n",
            f"{contract.M_REQUESTS_WAITING}: bad value -2.0",
        ),
        (
            f"{contract.M_KV_USAGE} zero\n",
            "not Prometheus text format: could not convert string to float: 'zero'",
        ),
        ("<html>oops</html>", f"{contract.M_KV_USAGE}: missing from /metrics (and vllm:kv_cache_usage_perc)"),
        ("", f"{contract.M_KV_USAGE}: missing from /metrics (and vllm:kv_cache_usage_perc)"),
    ],
)
def test_bad_answers_are_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(MetricsParseError) as info:
        parse_engine_metrics(text)
    assert str(info.value) == message


def test_only_the_needed_series_are_parsed_and_odd_lines_elsewhere_do_not_matter() -> None:
    # A malformed line of a metric the autoscaler does not read is not its problem.
    text = engine_exposition() + 'baton_other_metric{broken="x} 1\n'
    assert parse_engine_metrics(text).kv_usage == 0.42


def test_a_longer_name_sharing_the_prefix_is_not_mistaken_for_a_needed_metric() -> None:
    text = (
        f"{contract.M_KV_USAGE}_max 0.9\n{contract.M_KV_USAGE} 0.5\n"
        f"{contract.M_REQUESTS_WAITING}_peak 40\n{contract.M_REQUESTS_WAITING} 1\n"
        f"{contract.M_REQUESTS_RUNNING}\t2\n"
    )
    assert parse_engine_metrics(text) == EngineLoad(waiting=1.0, running=2.0, kv_usage=0.5)


def test_metrics_url() -> None:
    assert metrics_url("127.0.0.7", 8000) == "http://127.0.0.7:8000/metrics"
    assert metrics_url("fd00::5", 8000) == "http://[fd00::5]:8000/metrics"
