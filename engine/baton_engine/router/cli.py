"""``baton-router``: the OpenAI-compatible router in front of an engine deployment."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from baton_engine import contract
from baton_engine.router.discovery import (
    KubernetesDiscovery,
    default_namespace,
    selector_string,
    static_endpoints,
)
from baton_engine.router.endpoints import EndpointRegistry
from baton_engine.router.policy import ROUTINGS, PrefillWeights
from baton_engine.router.prefix import PREFIX_HASH_NONE, PREFIX_HASHES, block_hasher
from baton_engine.router.settings import MODES, RouterSettings

if TYPE_CHECKING:
    from baton_engine.router.app import DiscoveryTask
    from baton_engine.router.request_tokens import EngineRequestTokenizer

ENV_API_KEY = "BATON_ROUTER_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="baton-router",
        description="OpenAI-compatible router: sends each request through a prefill pod and a decode pod "
        "(disaggregated) or to one pod of an aggregated pool.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=contract.DEFAULT_ROUTER_PORT, help="port to listen on")
    p.add_argument("--model", default=None, help="served model name (answers /v1/models when no pod does)")
    p.add_argument("--mode", choices=MODES, default="disaggregated", help="deployment mode")
    p.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="prefix",
        help="prefix: prefill pods by a weighted score of cached prompt tokens and load (see "
        "--prefix-weight, --load-weight), decode pods by KV usage; round-robin: a baseline",
    )
    p.add_argument(
        "--prefix-weight",
        type=float,
        default=PrefillWeights.prefix,
        help="prefill score per prompt token the pod has cached (default %(default)s)",
    )
    p.add_argument(
        "--load-weight",
        type=float,
        default=PrefillWeights.load,
        help="prefill score subtracted per request waiting or running on the pod, in the same units: "
        "with the defaults one queued request outweighs 256 cached prompt tokens (default %(default)s)",
    )
    p.add_argument("--block-size", type=int, default=16, help="KV block size of the engines, in tokens")
    p.add_argument(
        "--prefix-hash",
        choices=PREFIX_HASHES,
        default=PREFIX_HASH_NONE,
        help="the engines' --prefix-hash, to compute their KV-event block keys from prompts; "
        "none: route by load only (vllm-sha256 is what vLLM pods use by default)",
    )
    p.add_argument(
        "--prefix-hash-seed",
        default=None,
        help="the engines' root seed of the vllm-* hashes (default: PYTHONHASHSEED if set, else "
        "vLLM's own default, as on the engines)",
    )
    p.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="subscribe to the prefill pods' KV events for prefix routing (needs --prefix-hash)",
    )
    p.add_argument(
        contract.FLAG_ROUTER_TOKENIZER,
        default=None,
        metavar="REF",
        help="the engines' model reference (builtin:NAME, hf:org/name from the local cache, a model "
        "directory or a .gguf file), to tokenize text prompts and chat messages exactly as the engines "
        "do for prefix routing (without it only token-id prompts are prefix-routed)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer <key>' from clients (default: ${ENV_API_KEY} if set)",
    )

    static = p.add_argument_group("static discovery")
    static.add_argument(
        "--prefill",
        nargs="+",
        default=[],
        metavar="URL",
        help="prefill pods' HTTP URLs (a fragment #kv-events=PORT,kv-replay=PORT sets one pod's ports)",
    )
    static.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode pods' HTTP URLs")
    static.add_argument("--engine", nargs="+", default=[], metavar="URL", help="aggregated pods' HTTP URLs")
    static.add_argument(
        "--kv-events-port",
        type=int,
        default=contract.DEFAULT_KV_EVENTS_PORT,
        help="static pods' KV-event port",
    )
    static.add_argument(
        "--kv-replay-port",
        type=int,
        default=contract.DEFAULT_KV_EVENTS_REPLAY_PORT,
        help="static pods' replay port",
    )

    k8s = p.add_argument_group("kubernetes discovery (watches Pods; in-cluster config or KUBECONFIG)")
    k8s.add_argument(
        contract.FLAG_ROUTER_DISCOVERY,
        choices=(contract.DISCOVERY_KUBERNETES, contract.DISCOVERY_STATIC),
        default=None,
        help="where pods come from (default: kubernetes when selectors or --k8s-deployment are given)",
    )
    k8s.add_argument(
        "--k8s-deployment",
        default=None,
        metavar="NAME",
        help="InferenceDeployment whose pods to route to (selects pods by the contract's labels)",
    )
    k8s.add_argument(
        "--k8s-namespace",
        contract.FLAG_ROUTER_NAMESPACE,
        dest="k8s_namespace",
        default=None,
        help="namespace of the pods (default: the router's own)",
    )
    k8s.add_argument("--prefill-selector", default=None, help="label selector of prefill pods (overrides)")
    k8s.add_argument("--decode-selector", default=None, help="label selector of decode pods (overrides)")
    k8s.add_argument("--engine-selector", default=None, help="label selector of aggregated pods (overrides)")

    tune = p.add_argument_group("tuning")
    tune.add_argument("--prefill-timeout", type=float, default=60.0, help="seconds for the whole prefill leg")
    tune.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to a pod")
    tune.add_argument(
        "--read-timeout", type=float, default=600.0, help="longest silence within an answer, seconds"
    )
    tune.add_argument("--max-connections", type=int, default=1024, help="upstream connection pool size")
    tune.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between /metrics scrapes")
    tune.add_argument("--scrape-timeout", type=float, default=0.5, help="seconds per /metrics scrape")
    hold = p.add_argument_group(
        "holding requests while a needed pool has no pod (scaled to zero, or every pod restarting)"
    )
    hold.add_argument(
        contract.FLAG_ROUTER_HOLD_QUEUE,
        type=int,
        default=RouterSettings.hold_queue,
        metavar="N",
        help="requests held at most at once; more get 503 with Retry-After (0: 503 at once)",
    )
    hold.add_argument(
        contract.FLAG_ROUTER_HOLD_TIMEOUT,
        type=float,
        default=RouterSettings.hold_timeout_s,
        metavar="SECONDS",
        help="longest one request is held before it gets 503 with Retry-After",
    )
    hold.add_argument(
        "--hold-retry-after",
        type=float,
        default=RouterSettings.hold_retry_after_s,
        metavar="SECONDS",
        help="the Retry-After of those 503 answers",
    )
    tune.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _discovery(
    args: argparse.Namespace, settings: RouterSettings, registry: EndpointRegistry, p: argparse.ArgumentParser
) -> list[DiscoveryTask]:
    by_role = {
        contract.ROLE_PREFILL: args.prefill,
        contract.ROLE_DECODE: args.decode,
        contract.ROLE_AGGREGATED: args.engine,
    }
    overrides = {
        contract.ROLE_PREFILL: args.prefill_selector,
        contract.ROLE_DECODE: args.decode_selector,
        contract.ROLE_AGGREGATED: args.engine_selector,
    }
    use_static = any(by_role.values())
    use_k8s = args.k8s_deployment is not None or any(overrides.values())
    if args.discovery == contract.DISCOVERY_KUBERNETES and not use_k8s:
        p.error("--discovery kubernetes needs --k8s-deployment or --<role>-selector")
    if args.discovery == contract.DISCOVERY_STATIC and use_k8s:
        p.error("--discovery static takes --prefill/--decode/--engine URLs, not selectors")
    if use_static and use_k8s:
        p.error(
            "choose static URLs (--prefill/--decode/--engine) or Kubernetes discovery (--k8s-*), not both"
        )
    if not use_static and not use_k8s:
        p.error("no pods: give --prefill and --decode URLs, --engine URLs, or --k8s-deployment")
    for role, values in {**(by_role if use_static else {}), **(overrides if use_k8s else {})}.items():
        if values and role not in settings.roles:
            p.error(f"--mode {settings.mode} does not use {role} pods (flag for role {role!r} given)")
    if use_static:
        for role in settings.roles:
            if not by_role[role]:
                flag = "--engine" if role == contract.ROLE_AGGREGATED else f"--{role}"
                p.error(f"--mode {settings.mode} needs {flag} URLs")
        try:
            ports = {
                contract.PORT_KV_EVENTS: args.kv_events_port,
                contract.PORT_KV_EVENTS_REPLAY: args.kv_replay_port,
            }
            for endpoint in static_endpoints({r: by_role[r] for r in settings.roles}, ports=ports):
                registry.upsert(endpoint)
        except ValueError as exc:
            p.error(str(exc))
        return []
    selectors = {}
    for role in settings.roles:
        if overrides[role]:
            selectors[role] = overrides[role]
        elif args.k8s_deployment:
            selectors[role] = selector_string(contract.pod_selector(args.k8s_deployment, role))
        else:
            p.error(f"no selector for {role} pods: give --k8s-deployment or --{role}-selector")
    return [KubernetesDiscovery(args.k8s_namespace or default_namespace(), selectors)]


def _request_tokenizer(reference: str | None, p: argparse.ArgumentParser) -> EngineRequestTokenizer | None:
    """The engines' tokenizer and chat template (torch-free); None routes text prompts by load."""
    if reference is None:
        return None
    from baton_engine.model.loader.tokenizer_loading import load_tokenizer
    from baton_engine.router.request_tokens import EngineRequestTokenizer

    try:
        return EngineRequestTokenizer(load_tokenizer(reference))
    except ValueError as exc:  # ModelNotFoundError, NoTokenizerError, unsupported GGUF tokenizer
        p.error(f"{contract.FLAG_ROUTER_TOKENIZER} {reference}: {exc}")


def main(argv: Sequence[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    api_key = args.api_key if args.api_key is not None else os.environ.get(ENV_API_KEY) or None
    try:
        settings = RouterSettings(
            mode=args.mode,
            routing=args.routing,
            block_size=args.block_size,
            prefix_weight=args.prefix_weight,
            load_weight=args.load_weight,
            model=args.model,
            api_key=api_key,
            prefill_timeout_s=args.prefill_timeout,
            connect_timeout_s=args.connect_timeout,
            read_timeout_s=args.read_timeout,
            max_connections=args.max_connections,
            scrape_interval_s=args.scrape_interval,
            scrape_timeout_s=args.scrape_timeout,
            hold_queue=args.hold_queue,
            hold_timeout_s=args.hold_timeout,
            hold_retry_after_s=args.hold_retry_after,
        )
    except ValueError as exc:
        p.error(str(exc))
    if not 0 < args.port < 65536:
        p.error(f"--port: {args.port} is not a TCP port")
    registry = EndpointRegistry()
    discovery = _discovery(args, settings, registry, p)
    request_tokenizer = _request_tokenizer(args.tokenizer, p)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    import uvicorn  # imported after the flags are checked: a typo fails fast

    from baton_engine.router.app import create_app
    from baton_engine.router.kv_index import KVEventIndex
    from baton_engine.router.prefix import PrefixScorer

    hasher = block_hasher(args.prefix_hash, args.block_size, args.prefix_hash_seed)
    # Discovered pods declare their own hashing (annotations), so they may be prefix-routed even
    # when the flags' hash is none; static pods use the flags'.
    prefix_capable = hasher is not None or bool(discovery)
    kv_index = KVEventIndex() if prefix_capable and args.kv_events and args.routing == "prefix" else None
    scorer = PrefixScorer(
        tokenizer=request_tokenizer,
        hasher=hasher,
        index=kv_index,
        hasher_factory=block_hasher,
        default_prefix_hash=args.prefix_hash,
        default_block_size=args.block_size,
        default_seed=args.prefix_hash_seed,
    )
    app = create_app(settings, registry, discovery=discovery, scorer=scorer, kv_index=kv_index)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, access_log=False, timeout_keep_alive=75
    )
    sys.exit(0)


if __name__ == "__main__":
    main()
