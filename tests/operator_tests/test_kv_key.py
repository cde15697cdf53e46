"""The KV-compatibility key: which spec fields change it (table), its exact value, and where the
builders put it (pod label, engine flag, the router's hashing annotations)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from baton_engine import contract
from baton_operator.builders import BuildContext, Owner, desired_children
from baton_operator.models import EngineSpec, InferenceDeploymentSpec, ModelSpec
from baton_operator.rollout.kv_key import (
    KEY_FIELDS,
    NOT_KEY_FIELDS,
    key_inputs,
    kv_compat_key,
    resolved_kv_dtype,
)
from tests.operator_tests.cases import VALID_SPEC, merged

OWNER = Owner(name="demo", namespace="llm", uid="0f1e-uid")
BASE_MODEL: dict[str, Any] = {"name": "smollm2", "source": "builtin:smollm2-135m-instruct"}
BASE_ENGINE: dict[str, Any] = {"device": "cuda", "dtype": "bfloat16"}
#: The default deployment's key. It must never change by accident: every pod of every
#: deployment would roll to a new generation on the operator's upgrade. (Schema 2 changed it on
#: purpose: the tensor-parallel size left the key once P/D worked across TP sizes.)
DEFAULT_KEY = "9b3e36acc617fe58"


def key(model: dict[str, Any] | None = None, **engine: Any) -> str:
    return kv_compat_key(
        ModelSpec.model_validate({**BASE_MODEL, **(model or {})}),
        EngineSpec.model_validate({**BASE_ENGINE, **engine}),
    )


BASE_KEY = key()

# (what changes, model fields, engine fields, whether the key changes)
CASES: list[tuple[str, dict[str, Any], dict[str, Any], bool]] = [
    ("model source", {"source": "builtin:other-model"}, {}, True),
    ("model source (pvc)", {"source": "pvc://weights/smollm2"}, {}, True),
    ("served model name", {"name": "renamed"}, {}, False),
    ("dtype", {}, {"dtype": "float32"}, True),
    ("dtype float16", {}, {"dtype": "float16"}, True),
    ("dtype auto on cuda = bfloat16", {}, {"dtype": "auto"}, False),
    ("dtype auto on cpu = float32", {}, {"dtype": "auto", "device": "cpu"}, True),
    ("block size", {}, {"blockSize": 32}, True),
    ("block size 1", {}, {"blockSize": 1, "maxNumBatchedTokens": 1}, True),
    ("prefix hash", {}, {"prefixHash": "vllm-sha256-cbor"}, True),
    ("fp8 kv cache", {}, {"kvCacheDtype": "fp8"}, True),
    ("kv cache dtype auto", {}, {"kvCacheDtype": "auto"}, False),
    ("fp8 weights", {}, {"quantization": "fp8"}, True),
    ("device with an explicit dtype", {}, {"device": "cpu"}, False),
    ("image", {}, {"image": "registry.local/baton-engine:0.2.0"}, False),
    ("pull policy", {}, {"imagePullPolicy": "Always"}, False),
    ("env", {}, {"env": [{"name": "PLAIN", "value": "1"}]}, False),
    ("extra args", {}, {"extraArgs": ["--seed", "3"]}, False),
    ("max num seqs", {}, {"maxNumSeqs": 4}, False),
    ("step budget", {}, {"maxNumBatchedTokens": 512}, False),
    ("context length", {}, {"maxModelLen": 8192}, False),
    ("kv blocks", {}, {"numKvBlocks": 100}, False),
    ("memory fraction", {}, {"gpuMemoryUtilization": 0.5}, False),
    ("prefix caching", {}, {"prefixCaching": False}, False),
    ("chunked prefill", {}, {"chunkedPrefill": False, "maxNumBatchedTokens": 4096}, False),
    ("queue bound", {}, {"maxQueuedRequests": 8}, False),
    ("http port", {}, {"port": 9000}, False),
    ("tensor-parallel size", {}, {"tensorParallelSize": 2}, False),  # P/D works across TP sizes
]


@pytest.mark.parametrize(("model", "engine", "changes"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_which_fields_change_the_key(model: dict[str, Any], engine: dict[str, Any], changes: bool) -> None:
    assert (key(model, **engine) != BASE_KEY) is changes


def test_prefix_hash_seed_changes_the_key() -> None:
    vllm = key(prefixHash="vllm-sha256")
    assert len({vllm, key(prefixHash="vllm-sha256", prefixHashSeed="42"), BASE_KEY}) == 3


def test_hf_revision_changes_the_key() -> None:
    hf = {"source": "hf:HuggingFaceTB/SmolLM2-135M-Instruct"}
    main, pinned = key(hf), key({**hf, "revision": "12fd25f"})
    assert len({main, pinned, key({**hf, "revision": "v2"}), BASE_KEY}) == 4
    assert key({**hf, "revision": "12fd25f"}) == pinned  # deterministic


def test_every_engine_field_is_classified() -> None:
    """A field added to EngineSpec must be put in KEY_FIELDS or NOT_KEY_FIELDS (KV-cache dtype
    and quantization are key fields when they appear)."""
    fields = set(EngineSpec.model_fields)
    assert KEY_FIELDS.isdisjoint(NOT_KEY_FIELDS)
    unclassified = sorted(fields - KEY_FIELDS - NOT_KEY_FIELDS)
    assert unclassified == [], f"classify these EngineSpec fields in rollout/kv_key.py: {unclassified}"
    assert NOT_KEY_FIELDS <= fields  # no stale names
    # Key fields the model has today are digested (the others enter key_inputs when they appear).
    inputs = key_inputs(ModelSpec.model_validate(BASE_MODEL), EngineSpec.model_validate(BASE_ENGINE))
    assert inputs == {
        "schema": 2,
        "modelSource": "builtin:smollm2-135m-instruct",
        "modelRevision": "",
        "kvDtype": "bfloat16",
        "blockSize": 16,
        "prefixHash": "fast",
        "prefixHashSeed": "",
        "quantization": "none",
    }


def test_exact_key_of_the_default_deployment() -> None:
    spec = InferenceDeploymentSpec.model_validate({"model": BASE_MODEL})
    assert kv_compat_key(spec.model, spec.engine) == DEFAULT_KEY
    assert re.fullmatch(r"[0-9a-f]{16}", DEFAULT_KEY)


@pytest.mark.parametrize(
    ("device", "dtype", "resolved"),
    [("cpu", "auto", "float32"), ("cuda", "auto", "bfloat16"), ("cpu", "float16", "float16")],
)
def test_resolved_kv_dtype(device: str, dtype: str, resolved: str) -> None:
    assert resolved_kv_dtype(EngineSpec.model_validate({"device": device, "dtype": dtype})) == resolved


def _engine_pods(patch: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = InferenceDeploymentSpec.model_validate(merged(VALID_SPEC, patch))
    children = desired_children(BuildContext(owner=OWNER, spec=spec), "ab" * 32)
    return {
        m["metadata"]["name"]: m["spec"]["template"]
        for m in children.applied
        if m["kind"] == "Deployment" and not m["metadata"]["name"].endswith("-router")
    }


def test_engine_pods_carry_the_key_as_label_and_flag_and_their_hashing_as_annotations() -> None:
    pods = _engine_pods({"engine": {"blockSize": 32, "dtype": "float32", "maxNumBatchedTokens": 64}})
    spec = InferenceDeploymentSpec.model_validate(
        merged(VALID_SPEC, {"engine": {"blockSize": 32, "dtype": "float32", "maxNumBatchedTokens": 64}})
    )
    want = kv_compat_key(spec.model, spec.engine)
    assert sorted(pods) == ["demo-decode", "demo-prefill"]
    for template in pods.values():
        args = template["spec"]["containers"][0]["args"]
        assert template["metadata"]["labels"][contract.LABEL_KV_COMPAT] == want
        assert args[args.index(contract.FLAG_KV_COMPAT_KEY) + 1] == want
        annotations = template["metadata"]["annotations"]
        assert annotations[contract.ANNOTATION_BLOCK_SIZE] == "32"
        assert annotations[contract.ANNOTATION_PREFIX_HASH] == "fast"


def test_a_role_on_another_device_with_dtype_auto_gets_another_key() -> None:
    """dtype auto resolves per pod: a CPU prefill pool (float32) and a GPU decode pool
    (bfloat16) cannot exchange KV, and their keys say so (the router never pairs them)."""
    pods = _engine_pods(
        {"engine": {"dtype": "auto", "device": "cuda"}, "prefill": {"engine": {"device": "cpu"}}}
    )
    keys = {name: t["metadata"]["labels"][contract.LABEL_KV_COMPAT] for name, t in pods.items()}
    assert keys["demo-prefill"] != keys["demo-decode"]
    assert keys["demo-prefill"] == key(dtype="float32")
    assert keys["demo-decode"] == key(dtype="bfloat16")
