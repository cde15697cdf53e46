"""The pydantic models: defaults, aliases, overrides, and the same refusals as the CRD."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from baton_operator.models import InferenceDeploymentSpec, parse_source
from baton_operator.models.source import ModelSource
from baton_operator.models.spec import kv_transfer_range_errors, kv_transfer_range_message
from tests.operator_tests.cases import SPEC_CASES, VALID_SPEC, Case


def test_defaults_of_a_minimal_spec() -> None:
    spec = InferenceDeploymentSpec.model_validate(VALID_SPEC)
    assert spec.mode == "disaggregated"
    assert list(spec.roles()) == ["prefill", "decode"]
    assert spec.engine.block_size == 16
    assert spec.engine.max_num_batched_tokens == 2048
    assert spec.kv_transfer.port == 5600
    assert (spec.kv_events.port, spec.kv_events.replay_port) == (5557, 5558)
    assert spec.autoscaling.mode == "off"
    assert spec.autoscaling.decode.target_kv_usage == 0.7
    assert spec.autoscaling.scale_down.stabilization_window_seconds == 300
    assert spec.roles()["prefill"].resources.gpu_resource == "amd.com/gpu"


def test_camel_case_aliases_round_trip() -> None:
    spec = InferenceDeploymentSpec.model_validate(
        {**VALID_SPEC, "autoscaling": {"decode": {"targetKVUsage": 0.5}}, "kvTransfer": {"leaseSeconds": 9}}
    )
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["autoscaling"]["decode"]["targetKVUsage"] == 0.5
    assert dumped["kvTransfer"]["leaseSeconds"] == 9
    assert dumped["engine"]["maxNumBatchedTokens"] == 2048
    assert InferenceDeploymentSpec.model_validate(dumped) == spec


def test_role_overrides_merge_over_the_top_level_engine() -> None:
    spec = InferenceDeploymentSpec.model_validate(
        {
            **VALID_SPEC,
            "engine": {"maxNumSeqs": 64, "image": "img:1"},
            "prefill": {"engine": {"maxNumSeqs": 8, "chunkedPrefill": False, "maxNumBatchedTokens": 4096}},
        }
    )
    prefill = spec.engine.merged(spec.roles()["prefill"].engine)
    decode = spec.engine.merged(spec.roles()["decode"].engine)
    assert (prefill.max_num_seqs, prefill.chunked_prefill, prefill.max_num_batched_tokens) == (8, False, 4096)
    assert prefill.image == "img:1"
    assert (decode.max_num_seqs, decode.chunked_prefill, decode.max_num_batched_tokens) == (64, True, 2048)


def test_aggregated_mode_has_one_pool() -> None:
    spec = InferenceDeploymentSpec.model_validate(
        {**VALID_SPEC, "mode": "aggregated", "pool": {"replicas": 3}}
    )
    assert list(spec.roles()) == ["engine"]
    assert spec.roles()["engine"].replicas == 3


@pytest.mark.parametrize(
    ("source", "parsed"),
    [
        ("builtin:smollm2-135m-instruct", ModelSource("builtin", "builtin:smollm2-135m-instruct")),
        ("pvc://models/llama/3-8b", ModelSource("pvc", "models", "llama/3-8b")),
        ("pvc://models", ModelSource("pvc", "models", "")),
        ("hf:HuggingFaceTB/SmolLM2-135M-Instruct", ModelSource("hf", "HuggingFaceTB/SmolLM2-135M-Instruct")),
    ],
)
def test_parse_source(source: str, parsed: ModelSource) -> None:
    assert parse_source(source) == parsed


@pytest.mark.parametrize("source", ["s3://b/m", "pvc://Models/x", "hf:only-org", "pvc://m/../x", "builtin:"])
def test_parse_source_refuses(source: str) -> None:
    with pytest.raises(ValueError, match="spec.model.source: .* is not builtin:NAME"):
        parse_source(source)


@pytest.mark.parametrize("case", SPEC_CASES, ids=lambda c: c.id)
def test_models_refuse_what_the_crd_refuses(case: Case) -> None:
    with pytest.raises(ValidationError) as err:
        InferenceDeploymentSpec.model_validate(case.spec())
    assert case.pydantic_fragment() in str(err.value)


OTHERS = {"engine.port": 8000, "kvEvents.port": 5557, "kvEvents.replayPort": 5558}


@pytest.mark.parametrize(
    ("kv_port", "tp", "others", "refused"),
    [
        (5600, 1, OTHERS, []),
        (5555, 2, OTHERS, []),  # 5555..5556 touches kvEvents.port
        (5556, 2, OTHERS, ["kvEvents.port"]),  # 5556..5557: over it by one
        (5556, 3, OTHERS, ["kvEvents.port", "kvEvents.replayPort"]),
        (5557, 4, OTHERS, ["kvEvents.replayPort"]),  # the base port's own clash is the pairwise rule's
        (7993, 8, OTHERS, ["engine.port"]),  # 7993..8000
        (7992, 8, OTHERS, []),  # 7992..7999
        (65532, 4, OTHERS, []),  # ends at 65535
        (65533, 4, OTHERS, [None]),  # would end at 65536
        (65534, 64, {"engine.port": 65535}, ["engine.port", None]),
    ],
)
def test_kv_transfer_range_errors(
    kv_port: int, tp: int, others: dict[str, int], refused: list[str | None]
) -> None:
    assert kv_transfer_range_errors(kv_port, tp, others, "prefill") == [
        kv_transfer_range_message("prefill", name) for name in refused
    ]


def test_kv_transfer_range_messages_name_the_fields() -> None:
    assert kv_transfer_range_message("pool", "engine.port") == (
        "spec.engine.port must be outside spec.kvTransfer.port .. spec.kvTransfer.port + "
        "spec.pool.engine.tensorParallelSize - 1 (the pool pods' ranks serve KV on one port each)"
    )
    assert kv_transfer_range_message("prefill", None) == (
        "spec.kvTransfer.port .. spec.kvTransfer.port + spec.prefill.engine.tensorParallelSize - 1 must end "
        "at or below 65535 (the prefill pods' ranks serve KV on one port each)"
    )
