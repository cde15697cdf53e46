"""`baton-operator`: `crd` writes the generated CRD; `run` starts the operator."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from baton_engine import contract


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton-operator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    crd = sub.add_parser("crd", help="write the InferenceDeployment CRD (crds/ and the chart's crds/)")
    crd.add_argument("--root", type=Path, default=Path("."), help="repository root to write under")
    crd.add_argument("--stdout", action="store_true", help="print the CRD instead of writing files")

    run = sub.add_parser("run", help="run the operator")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], help="watch this namespace")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    run.add_argument(
        "--metrics-port",
        type=int,
        default=contract.DEFAULT_OPERATOR_METRICS_PORT,
        help="Prometheus metrics port (0 disables)",
    )
    run.add_argument("--health-port", type=int, default=8081, help="liveness endpoint port (/healthz)")
    run.add_argument("--bind", default="0.0.0.0", help="address the metrics and liveness endpoints bind")
    run.add_argument("--peering", default="baton-operator", help="Kopf peering name (one active replica)")
    run.add_argument("--no-peering", action="store_true", help="run standalone, without peering")
    run.add_argument("--resync-seconds", type=float, default=60.0, help="periodic reconcile interval")
    run.add_argument(
        "--monitoring-namespace",
        default="",
        help="namespace allowed to scrape engine pods through their NetworkPolicy",
    )
    run.add_argument("--verbose", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "crd":
        from baton_operator import crd

        if args.stdout:
            sys.stdout.write(crd.render())
        else:
            for path in crd.write(args.root):
                print(path)
        return 0
    from baton_operator.runner import RunOptions, run

    return run(
        RunOptions(
            namespaces=tuple(args.namespace),
            all_namespaces=args.all_namespaces or not args.namespace,
            metrics_port=args.metrics_port,
            health_port=args.health_port,
            bind=args.bind,
            peering=None if args.no_peering else args.peering,
            resync_seconds=args.resync_seconds,
            monitoring_namespace=args.monitoring_namespace,
            verbose=args.verbose,
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
