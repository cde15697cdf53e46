"""`baton-dev cluster up|down|status|env`: the local control plane from the command line."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from baton_dev.binaries import BinariesMissing, find_binaries
from baton_dev.cluster import (
    ClusterAlreadyRunning,
    cluster_dir,
    component_status,
    start_cluster,
    stop_cluster,
)
from baton_dev.health import ComponentFailed, http_ok
from baton_dev.kubeapi import ApiAccess
from baton_dev.spec import ClusterSpec
from baton_dev.state import ClusterState


def _state(name: str) -> ClusterState:
    return ClusterState.load(cluster_dir(name))


def cmd_up(args: argparse.Namespace) -> int:
    spec = ClusterSpec(
        name=args.name,
        kwok_nodes=args.kwok_nodes,
        kwok_gpus=args.kwok_gpus,
        process_nodes=args.process_nodes,
        process_gpus=args.process_gpus,
        backoff_initial_s=args.backoff_initial,
        backoff_max_s=args.backoff_max,
        use_service_account_credentials=not args.no_sa_credentials,
    )
    state = start_cluster(
        spec, find_binaries(), timeout_s=args.timeout, log=lambda m: print(f"baton-dev: {m}")
    )
    print(f"cluster {state.name!r} ready in {state.ready_s:.1f} s")
    print(f"  kubeconfig (admin):      {state.admin_kubeconfig}")
    print(f"  kubeconfig (restricted): {state.restricted_kubeconfig}")
    print(f"  logs:                    {state.logs_dir}  (pod processes: {state.agent_dir / 'pods'})")
    print(f'  shell setup:             eval "$(baton-dev cluster env --name {state.name})"')
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    directory = cluster_dir(args.name)
    if not (directory / "state.json").exists():
        print(f"cluster {args.name!r} is not up (no state in {directory})")
        return 0
    stopped = stop_cluster(ClusterState.load(directory))
    print(f"cluster {args.name!r} stopped ({len(stopped)} processes: {', '.join(stopped) or 'none running'})")
    print(f"  logs kept in {directory / 'logs'}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = _state(args.name)
    statuses = component_status(state)
    print(f"cluster {state.name!r} ({state.directory}), API server {state.server}")
    for name, status in statuses.items():
        print(f"  {name:<24} {status}")
    token = ApiAccess.from_kubeconfig(state.admin_kubeconfig).token
    api_ready = http_ok(f"{state.server}/readyz", ca_file=str(state.ca_file), token=token)()
    print(f"  {'API /readyz':<24} {'ok' if api_ready else 'not answering'}")
    running = all(s.startswith("running") for s in statuses.values())
    return 0 if running and api_ready else 1


def cmd_env(args: argparse.Namespace) -> int:
    state = _state(args.name)
    path = f"{state.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    print(f"export KUBECONFIG={shlex.quote(str(state.admin_kubeconfig))}")
    print(f"export PATH={shlex.quote(path)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton-dev", description="Baton's local development tools")
    groups = parser.add_subparsers(dest="group", required=True)
    cluster = groups.add_parser("cluster", help="the local Kubernetes control plane")
    commands = cluster.add_subparsers(dest="command", required=True)
    defaults = ClusterSpec()

    def named(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--name", default=defaults.name, help="cluster name (default %(default)s)")
        return p

    up = named(commands.add_parser("up", help="start a cluster; returns once it is ready"))
    up.add_argument(
        "--kwok-nodes", type=int, default=defaults.kwok_nodes, help="fake nodes where nothing runs"
    )
    up.add_argument("--kwok-gpus", type=int, default=defaults.kwok_gpus, help="amd.com/gpu per kwok node")
    up.add_argument("--process-nodes", type=int, default=defaults.process_nodes, help="nodes that run pods")
    up.add_argument(
        "--process-gpus", type=int, default=defaults.process_gpus, help="amd.com/gpu per process node"
    )
    up.add_argument(
        "--backoff-initial", type=float, default=defaults.backoff_initial_s, help="restart back-off, s"
    )
    up.add_argument(
        "--backoff-max", type=float, default=defaults.backoff_max_s, help="restart back-off cap, s"
    )
    up.add_argument("--no-sa-credentials", action="store_true", help="one KCM identity for all controllers")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for readiness")
    up.set_defaults(func=cmd_up)
    named(commands.add_parser("down", help="stop every process of the cluster")).set_defaults(func=cmd_down)
    named(commands.add_parser("status", help="show each component")).set_defaults(func=cmd_status)
    named(commands.add_parser("env", help="print shell exports (KUBECONFIG, PATH)")).set_defaults(
        func=cmd_env
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
    except (BinariesMissing, ClusterAlreadyRunning, ComponentFailed, FileNotFoundError, ValueError) as e:
        print(f"baton-dev: error: {e}", file=sys.stderr)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
