"""The command lines the operator renders into pods are accepted by the programs that run them:
`baton-engine serve` (prefill and decode) and `baton-router` — the seam the demo crosses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from baton_engine import contract
from baton_engine.prefix.hashing import EventKeyHasher
from baton_engine.router.cli import _discovery, _request_tokenizer, build_parser
from baton_engine.router.discovery import KubernetesDiscovery, pod_hashing
from baton_engine.router.endpoints import EndpointRegistry
from baton_engine.router.settings import RouterSettings
from baton_operator import models
from baton_operator.builders import BuildContext, Owner, desired_children

REPO = Path(__file__).resolve().parents[2]


def containers(example: str) -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load((REPO / "examples" / example).read_text())
    spec = models.InferenceDeploymentSpec.model_validate(doc["spec"])
    owner = Owner(name=doc["metadata"]["name"], namespace="demo-ns", uid="uid-1")
    children = desired_children(BuildContext(owner=owner, spec=spec), "k" * 32)
    return {
        m["metadata"]["name"]: m["spec"]["template"]["spec"]["containers"][0]
        for m in children.applied
        if m["kind"] == "Deployment"
    }


def pod_ip(args: list[str]) -> list[str]:
    return [a.replace(f"$({contract.ENV_POD_IP})", "127.2.0.9") for a in args]


def test_router_accepts_the_rendered_flags() -> None:
    router = containers("smollm2-pd.yaml")["smollm2-pd-router"]
    assert router["command"] == ["baton-router"]
    parser = build_parser()
    args = parser.parse_args(pod_ip(router["args"]))
    where = (args.discovery, args.k8s_namespace, args.host, args.port)
    assert where == ("kubernetes", "demo-ns", "127.2.0.9", 8080)
    assert (args.kv_events, args.model) == (True, "smollm2")
    # No hashing flags: the router hashes each pod's prompts as its annotations say (below).
    assert (args.prefix_hash, args.block_size) == ("none", 16)
    settings = RouterSettings(mode=args.mode, block_size=args.block_size, model=args.model)
    [discovery] = _discovery(args, settings, EndpointRegistry(), parser)
    assert isinstance(discovery, KubernetesDiscovery)
    assert discovery.namespace == "demo-ns"
    assert discovery.selectors == {
        "prefill": "baton.dev/deployment=smollm2-pd,baton.dev/role=prefill",
        "decode": "baton.dev/deployment=smollm2-pd,baton.dev/role=decode",
    }
    # The builtin reference's GGUF tokenizer loads without torch: text prompts route by prefix.
    tokenizer = _request_tokenizer(args.tokenizer, parser)
    assert tokenizer is not None
    ids = tokenizer.prompt_token_ids("completions", {"prompt": "Hello"})
    assert ids == tokenizer.tokenizer.encode("Hello")


def test_router_accepts_the_rendered_flags_of_an_aggregated_deployment() -> None:
    """Aggregated mode: the router is told its mode, so it takes the engine pool's selector (it
    refused a router without ``--mode aggregated``: the default mode routes to prefill/decode)."""
    doc = yaml.safe_load((REPO / "examples" / "smollm2-pd.yaml").read_text())
    doc["spec"]["mode"] = "aggregated"
    for role in ("prefill", "decode"):
        doc["spec"].pop(role, None)
    spec = models.InferenceDeploymentSpec.model_validate(doc["spec"])
    children = desired_children(BuildContext(owner=Owner("agg", "demo-ns", "uid-1"), spec=spec), "k" * 32)
    [router] = [
        m["spec"]["template"]["spec"]["containers"][0]
        for m in children.applied
        if m["kind"] == "Deployment" and m["metadata"]["name"] == "agg-router"
    ]
    parser = build_parser()
    args = parser.parse_args(pod_ip(router["args"]))
    assert args.mode == "aggregated"
    settings = RouterSettings(mode=args.mode, block_size=args.block_size, model=args.model)
    [discovery] = _discovery(args, settings, EndpointRegistry(), parser)
    assert isinstance(discovery, KubernetesDiscovery)
    assert discovery.selectors == {"engine": "baton.dev/deployment=agg,baton.dev/role=engine"}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_router_hashes_each_pod_as_its_engine_flags_say(role: str) -> None:
    """The annotations the router reads (discovery.pod_hashing) equal the pod's own engine flags,
    and the pod's KV-compatibility label equals its --kv-compat-key."""
    doc = yaml.safe_load((REPO / "examples" / "smollm2-pd.yaml").read_text())
    spec = models.InferenceDeploymentSpec.model_validate(doc["spec"])
    children = desired_children(
        BuildContext(owner=Owner("smollm2-pd", "demo-ns", "uid-1"), spec=spec), "k" * 32
    )
    [template] = [
        m["spec"]["template"]
        for m in children.applied
        if m["kind"] == "Deployment" and m["metadata"]["name"] == f"smollm2-pd-{role}"
    ]
    args = template["spec"]["containers"][0]["args"]

    def flag(name: str) -> str:
        return str(args[args.index(name) + 1])

    block_size, prefix_hash, seed = pod_hashing(template["metadata"])
    assert (block_size, prefix_hash) == (int(flag(contract.FLAG_BLOCK_SIZE)), flag(contract.FLAG_PREFIX_HASH))
    assert seed is None and contract.FLAG_PREFIX_HASH_SEED not in args
    assert template["metadata"]["labels"][contract.LABEL_KV_COMPAT] == flag(contract.FLAG_KV_COMPAT_KEY)


def test_router_discovery_flag_errors(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for argv, message in [
        (["--discovery", "kubernetes"], "--discovery kubernetes needs --k8s-deployment or --<role>-selector"),
        (
            ["--discovery", "static", "--prefill-selector", "a=b", "--decode-selector", "c=d"],
            "--discovery static takes --prefill/--decode/--engine URLs, not selectors",
        ),
    ]:
        args = parser.parse_args(argv)
        with pytest.raises(SystemExit):
            _discovery(args, RouterSettings(), EndpointRegistry(), parser)
        assert message in capsys.readouterr().err


def test_fast_prefix_hash_matches_the_engines() -> None:
    from baton_engine.prefix.hashing import chain_hashes, fast_prefix_hash, to_event_hash

    hasher = EventKeyHasher.named("fast", 4)
    tokens = list(range(10, 21))
    expected = [to_event_hash(h) for h in chain_hashes(fast_prefix_hash, tokens, 4)]
    assert hasher.block_hashes(tokens) == expected
    assert len(expected) == 2


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_accepts_the_rendered_flags(role: str) -> None:
    from baton_engine.cli import build_parser as engine_parser
    from baton_engine.cli import config_from_args

    engine = containers("smollm2-pd.yaml")[f"smollm2-pd-{role}"]
    assert engine["command"] == ["baton-engine", "serve"]
    config = config_from_args(engine_parser().parse_args(["serve", *pod_ip(engine["args"])]))
    assert (config.host, config.device, config.dtype, config.kv_role) == (
        "127.2.0.9", "cpu", "float32", "producer" if role == "prefill" else "consumer",
    )  # fmt: skip
    assert (config.num_kv_blocks, config.max_model_len, config.prefix_hash) == (512, 2048, "fast")
