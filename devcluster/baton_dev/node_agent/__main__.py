"""`python -m baton_dev.node_agent`: run the process nodes of one local cluster until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from baton_dev.kubeapi import ApiAccess, AsyncKubeApi
from baton_dev.node_agent.context import AgentContext
from baton_dev.node_agent.node import ProcessNode
from baton_dev.node_agent.pod_range import PodRange, claim_pod_range
from baton_dev.spec import process_node_name

SHUTDOWN_GRACE_CAP_S = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m baton_dev.node_agent", description=__doc__)
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--state-dir", type=Path, required=True, help="pod logs, kubeconfigs, pid files, events")
    p.add_argument("--nodes", type=int, default=1, help="number of process nodes")
    p.add_argument("--gpus", type=int, default=8, help="amd.com/gpu capacity per node")
    p.add_argument("--backoff-initial", type=float, default=10.0, help="restart back-off start, seconds")
    p.add_argument("--backoff-max", type=float, default=300.0, help="restart back-off cap, seconds")
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    with claim_pod_range() as pod_range:
        await _run(args, pod_range)


async def _run(args: argparse.Namespace, pod_range: PodRange) -> None:
    access = ApiAccess.from_kubeconfig(args.kubeconfig)
    api = AsyncKubeApi(access)
    ctx = AgentContext(api, access, args.state_dir, args.backoff_initial, args.backoff_max, args.gpus)
    ctx.pods_dir.mkdir(parents=True, exist_ok=True)
    ctx.pids_dir.mkdir(parents=True, exist_ok=True)
    nodes = [
        ProcessNode(ctx, process_node_name(i), pod_range.node_cidr(i), args.gpus) for i in range(args.nodes)
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await asyncio.gather(*(n.register() for n in nodes))
    tasks = [asyncio.create_task(coro) for n in nodes for coro in (n.heartbeat(), n.watch_pods())]
    logging.getLogger("baton_dev.node_agent").info("process nodes up: %s", ", ".join(n.name for n in nodes))
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(n.shutdown(SHUTDOWN_GRACE_CAP_S) for n in nodes))
    await api.aclose()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    main()
