"""What the operator renders for the vLLM-compatibility settings: the prefix-hash seed on the
engines and, through each pod's annotations, for the router (their keys must agree), and the
KV-event encoding on the engines."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from baton_engine import contract
from baton_operator.builders import BuildContext, Owner, desired_children
from baton_operator.models import InferenceDeploymentSpec
from tests.operator_tests.cases import VALID_SPEC, merged


def deployments(patch: dict[str, object]) -> dict[str, dict[str, Any]]:
    spec = InferenceDeploymentSpec.model_validate(merged(VALID_SPEC, patch))
    children = desired_children(BuildContext(Owner("demo", "llm", "uid"), spec), "ab" * 32)
    return {m["metadata"]["name"]: m for m in children.applied if m["kind"] == "Deployment"}


def args_by_deployment(patch: dict[str, object]) -> dict[str, list[str]]:
    return {
        name: d["spec"]["template"]["spec"]["containers"][0]["args"] for name, d in deployments(patch).items()
    }


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_vllm_keys_with_a_seed_reach_engines_and_router() -> None:
    args = args_by_deployment({"engine": {"prefixHash": "vllm-sha256", "prefixHashSeed": "0"}})
    for name in ("demo-prefill", "demo-decode"):
        assert flag(args[name], contract.FLAG_PREFIX_HASH) == "vllm-sha256"
        assert flag(args[name], contract.FLAG_PREFIX_HASH_SEED) == "0"
    # The router hashes each pod's prompts as the pod's annotations say, seed included (a new
    # seed is a new KV-compatibility key: rolled out without restarting the router).
    pods = deployments({"engine": {"prefixHash": "vllm-sha256", "prefixHashSeed": "0"}})
    for name in ("demo-prefill", "demo-decode"):
        annotations = pods[name]["spec"]["template"]["metadata"]["annotations"]
        assert annotations[contract.ANNOTATION_PREFIX_HASH] == "vllm-sha256"
        assert annotations[contract.ANNOTATION_PREFIX_HASH_SEED] == "0"
    assert contract.FLAG_ROUTER_PREFIX_HASH_SEED not in args["demo-router"]
    # Unset: no flag and no annotation, both sides use vLLM's default root.
    plain = deployments({"engine": {"prefixHash": "vllm-sha256"}})
    assert (
        contract.FLAG_PREFIX_HASH_SEED
        not in plain["demo-prefill"]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    for name in ("demo-prefill", "demo-decode"):
        assert (
            contract.ANNOTATION_PREFIX_HASH_SEED
            not in plain[name]["spec"]["template"]["metadata"]["annotations"]
        )


def test_the_kv_event_encoding_reaches_the_engines() -> None:
    assert flag(args_by_deployment({})["demo-prefill"], contract.FLAG_KV_EVENTS_ENCODING) == "map"
    legacy = args_by_deployment({"kvEvents": {"encoding": "array"}})
    assert flag(legacy["demo-decode"], contract.FLAG_KV_EVENTS_ENCODING) == "array"


@pytest.mark.parametrize(
    ("patch", "loc"),
    [
        ({"engine": {"prefixHash": "sha256"}}, ("engine", "prefixHash")),
        ({"engine": {"prefixHashSeed": ""}}, ("engine", "prefixHashSeed")),
        ({"kvEvents": {"encoding": "json"}}, ("kvEvents", "encoding")),
    ],
)
def test_bad_values_name_their_field(patch: dict[str, object], loc: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as err:
        InferenceDeploymentSpec.model_validate(merged(VALID_SPEC, patch))
    assert err.value.errors()[0]["loc"] == loc
