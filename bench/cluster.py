"""Local control plane timings: the recorded cold build of the binaries and the measured time
from `start_cluster` to ready (all nodes Ready) with binaries present.

    python -m bench.cluster --json [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from baton_dev.binaries import find_binaries
from baton_dev.cluster import start_cluster, stop_cluster
from baton_dev.spec import ClusterSpec


def recorded_cold_build(bin_dir: Path) -> dict[str, object]:
    """The first recorded build time of each binary (build.sh appends to build-times.tsv; the
    first line per binary is its cold build in this version-keyed directory)."""
    path = bin_dir / "build-times.tsv"
    if not path.exists():
        return {"cold_build_s": None, "cold_build_breakdown_s": {}}
    first: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stamp, name, seconds = line.split("\t")
        first.setdefault(name, int(seconds))
    return {"cold_build_s": sum(first.values()), "cold_build_breakdown_s": first}


def measure_warm_up(runs: int, spec: ClusterSpec) -> tuple[list[float], list[float]]:
    binaries = find_binaries()
    ups, downs = [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
            t0 = time.monotonic()
            state = start_cluster(spec, binaries, directory=Path(tmp) / "cluster")
            ups.append(time.monotonic() - t0)
            t1 = time.monotonic()
            stop_cluster(state)
            downs.append(time.monotonic() - t1)
    return ups, downs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kwok-nodes", type=int, default=2)
    parser.add_argument("--process-nodes", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one start and stop, 1 kwok node: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.kwok_nodes = 1, 1
    spec = ClusterSpec(name="bench", kwok_nodes=args.kwok_nodes, process_nodes=args.process_nodes)
    ups, downs = measure_warm_up(args.runs, spec)
    result = {
        "bench": "cluster",
        "quick": args.quick,
        **recorded_cold_build(find_binaries().directory),
        "warm_up_s": round(statistics.median(ups), 2),
        "warm_up_runs_s": [round(u, 2) for u in ups],
        "down_s": round(statistics.median(downs), 2),
        "kwok_nodes": args.kwok_nodes,
        "process_nodes": args.process_nodes,
    }
    if not args.json:
        for key, value in result.items():
            print(f"{key}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
