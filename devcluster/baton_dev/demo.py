"""`make demo` / `make demo-down`: Baton end to end on the local control plane.

up: start (or reuse) the cluster "demo" with a process node carrying fake `amd.com/gpu`, install
the Helm chart (the operator runs as a pod), apply examples/smollm2-pd.yaml on the process nodes,
wait for Ready, ask the router a question, show the resource and its autoscaler status, and leave
everything running. down: stop every process of the cluster, by pid.

Run as ``python -m baton_dev.demo up [--ci]`` / ``python -m baton_dev.demo down``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from baton_dev.binaries import BinariesMissing, find_binaries
from baton_dev.cluster import (
    cluster_dir,
    component_status,
    leftover_pod_processes,
    start_cluster,
    stop_cluster,
)
from baton_dev.demo_manifests import PROCESS_NODES, chart_values, with_node_selector
from baton_dev.demo_steps import DemoFailed, Progress
from baton_dev.health import ComponentFailed
from baton_dev.processes import is_alive
from baton_dev.spec import ClusterSpec
from baton_dev.state import ClusterState

REPO = Path(__file__).resolve().parents[2]
CLUSTER = "demo"
OPERATOR_NAMESPACE = "baton-system"
NAMESPACE = "baton-demo"
RELEASE = "baton"
EXAMPLE = REPO / "examples" / "smollm2-pd.yaml"
CHART = REPO / "charts" / "baton"
QUESTION = "What is the capital of France? Answer in one sentence."
ENV_NONINTERACTIVE = "DEMO_NONINTERACTIVE"
READY_TIMEOUT_S = float(os.environ.get("DEMO_READY_TIMEOUT_S", "900"))


@dataclass
class DemoResult:
    """What `up` leaves behind in <cluster dir>/demo.json (tests and scripts read it)."""

    kubeconfig: str
    namespace: str
    name: str
    router_url: str
    model: str
    answer: str
    seconds: float


class Tools:
    """kubectl and helm of the cluster, with the admin kubeconfig and the cluster's helm dirs."""

    def __init__(self, state: ClusterState, log_file: Path) -> None:
        self.state = state
        self.log_file = log_file
        self.env = dict(
            os.environ,
            KUBECONFIG=str(state.admin_kubeconfig),
            HELM_CACHE_HOME=str(state.directory / "helm-cache"),
            HELM_CONFIG_HOME=str(state.directory / "helm-config"),
            HELM_DATA_HOME=str(state.directory / "helm-data"),
        )

    def run(self, tool: str, *args: str, stdin: str | None = None, check: bool = True) -> str:
        argv = [str(self.state.bin_dir / tool), *args]
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=self.env, timeout=300)
        with self.log_file.open("a") as f:
            f.write(f"$ {tool} {shlex.join(args)}\n{result.stdout}{result.stderr}\n")
        if check and result.returncode != 0:
            command = f"{tool} {shlex.join(args)}"
            raise DemoFailed(f"{command} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        return self.run("kubectl", *args, stdin=stdin, check=check)

    def get_json(self, *args: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.kubectl("get", *args, "-o", "json"))
        return out


def _running(state: ClusterState) -> bool:
    return all(s.startswith("running") for s in component_status(state).values())


def _cluster(progress: Progress) -> ClusterState:
    directory = cluster_dir(CLUSTER)
    if (directory / "state.json").exists():
        state = ClusterState.load(directory)
        if _running(state):
            progress.say(f"      reusing the running cluster {CLUSTER!r} ({directory})")
            return state
        stop_cluster(state)  # a half-dead cluster: stop what is left, start afresh
    spec = ClusterSpec(name=CLUSTER, kwok_nodes=0, process_nodes=1, process_gpus=8)
    return start_cluster(spec, find_binaries(), timeout_s=180.0, log=lambda m: progress.say(f"      {m}"))


def _wait(what: str, check: Any, timeout_s: float, progress: Progress, report: Any = None) -> Any:
    deadline = time.monotonic() + timeout_s
    next_report = time.monotonic() + 15.0
    while True:
        value = check()
        if value:
            return value
        now = time.monotonic()
        if now > deadline:
            raise DemoFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        if report is not None and now >= next_report:
            progress.say(f"      ... {report()}")
            next_report = now + 15.0
        time.sleep(1.0)


def _pods_summary(tools: Tools, namespace: str) -> str:
    pods = tools.get_json("pods", "-n", namespace).get("items", [])
    parts = []
    for pod in pods:
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in pod.get("status", {}).get("conditions") or []
        )
        parts.append(f"{pod['metadata']['name']}: {pod['status'].get('phase')}{' Ready' if ready else ''}")
    return "; ".join(parts) or "no pods yet"


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return {}


def _router_url(tools: Tools, name: str) -> str:
    selector = f"baton.dev/deployment={name},baton.dev/role=router"
    pods = tools.get_json("pods", "-n", NAMESPACE, "-l", selector)["items"]
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        ports = [p for c in pod["spec"]["containers"] for p in c.get("ports", []) if p.get("name") == "http"]
        if ip and ports:
            return f"http://{ip}:{ports[0]['containerPort']}"
    raise DemoFailed(f"no router pod with an IP and an 'http' port matches {selector}")


def ask(router_url: str, model: str, question: str, max_tokens: int = 64) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    response = httpx.post(f"{router_url}/v1/chat/completions", json=body, timeout=300.0)
    if response.status_code != 200:
        raise DemoFailed(f"the router answered {response.status_code}: {response.text[:500]}")
    content = response.json()["choices"][0]["message"]["content"]
    return str(content)


def up(ci: bool) -> DemoResult:
    progress = Progress(total=7)
    progress.say(f"Baton demo: cluster {CLUSTER!r}, namespace {NAMESPACE!r}, {EXAMPLE.relative_to(REPO)}")
    with progress.step("control plane with a process node carrying 8 fake amd.com/gpu"):
        state = _cluster(progress)
    log_file = state.logs_dir / "demo.log"
    progress.attach_log(log_file)
    tools = Tools(state, log_file)
    progress.say(f"      kubeconfig {state.admin_kubeconfig}; component logs in {state.logs_dir}")

    values_file = state.directory / "demo-values.json"
    values_file.write_text(json.dumps(chart_values(PROCESS_NODES), indent=2))
    install = f"helm install {RELEASE} {CHART.relative_to(REPO)} (the operator as a pod)"
    with progress.step(install, str(log_file)):
        tools.run(
            "helm", "upgrade", "--install", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE,
            "--create-namespace", "-f", str(values_file),
        )  # fmt: skip
        _wait(
            "the operator pod to be Ready",
            lambda: "Ready" in _pods_summary(tools, OPERATOR_NAMESPACE),
            180.0,
            progress,
            lambda: _pods_summary(tools, OPERATOR_NAMESPACE),
        )

    doc = with_node_selector(yaml.safe_load(EXAMPLE.read_text()), PROCESS_NODES)
    name, model = doc["metadata"]["name"], doc["spec"]["model"]["name"]
    with progress.step(f"kubectl apply -f {EXAMPLE.relative_to(REPO)} (+ nodeSelector type=process)"):
        if not tools.kubectl("get", "namespace", NAMESPACE, "--ignore-not-found", "-o", "name").strip():
            tools.kubectl("create", "namespace", NAMESPACE)
        tools.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=json.dumps(doc))

    pod_logs = state.agent_dir / "pods"
    with progress.step(f"waiting for {name} to be Ready (SmolLM2 loads on CPU)", f"{pod_logs}/{NAMESPACE}_*"):

        def ready() -> bool:
            infd = tools.get_json("infd", name, "-n", NAMESPACE)
            return _condition(infd, "Ready").get("status") == "True"

        _wait(f"{name} Ready", ready, READY_TIMEOUT_S, progress, lambda: _pods_summary(tools, NAMESPACE))

    with progress.step("a chat completion through the router"):
        router_url = _router_url(tools, name)
        progress.say(f"      POST {router_url}/v1/chat/completions  Q: {QUESTION}")
        answer = ask(router_url, model, QUESTION)
        progress.say(f"      A: {answer.strip()}")
        if not answer.strip():
            raise DemoFailed("the model answered with empty text")

    with progress.step(f"kubectl get infd -n {NAMESPACE}"):
        progress.say(_indent(tools.kubectl("get", "infd", "-n", NAMESPACE)))
    with progress.step("the autoscaler's status (status.autoscaling)"):
        infd = tools.get_json("infd", name, "-n", NAMESPACE)
        mode = (infd["spec"].get("autoscaling") or {}).get("mode", "off")
        autoscaling = infd.get("status", {}).get("autoscaling")
        progress.say(f"      spec.autoscaling.mode: {mode}")
        if autoscaling:
            progress.say(_indent(yaml.safe_dump({"status.autoscaling": autoscaling}, sort_keys=True)))
        else:
            progress.say("      status.autoscaling: none reported")

    result = DemoResult(
        kubeconfig=str(state.admin_kubeconfig),
        namespace=NAMESPACE,
        name=name,
        router_url=router_url,
        model=model,
        answer=answer,
        seconds=round(progress.elapsed_s(), 1),
    )
    (state.directory / "demo.json").write_text(json.dumps(asdict(result), indent=2))
    _how_to(progress, state, result)
    if not ci and sys.stdin.isatty():
        _chat_loop(result)
    return result


def _indent(text: str) -> str:
    return "\n".join(f"      {line}" for line in text.rstrip().splitlines())


def _how_to(progress: Progress, state: ClusterState, result: DemoResult) -> None:
    body = json.dumps({"model": result.model, "messages": [{"role": "user", "content": "Hello!"}]})
    progress.say(
        f"""
Baton is running ({result.seconds:.0f} s). The cluster stays up until `make demo-down`.

  kubeconfig:      export KUBECONFIG={state.admin_kubeconfig}
  shell setup:     eval "$(.venv/bin/baton-dev cluster env --name {CLUSTER})"   # kubectl, helm on PATH
  resource:        kubectl get infd -n {result.namespace}
  router:          {result.router_url}  (OpenAI API)
  ask it:          curl -s {result.router_url}/v1/chat/completions -H 'Content-Type: application/json' \\
                     -d '{body}'
  logs:            {state.logs_dir} (control plane, demo.log); {state.agent_dir / "pods"} (pods)
  stop:            make demo-down
"""
    )


def _chat_loop(result: DemoResult) -> None:
    print("Ask the model something (an empty line ends):")
    while True:
        try:
            question = input("> ").strip()
        except EOFError:
            return
        if not question:
            return
        try:
            print(ask(result.router_url, result.model, question, max_tokens=128).strip())
        except (DemoFailed, httpx.HTTPError) as exc:
            print(f"error: {exc}")


def down() -> list[str]:
    directory = cluster_dir(CLUSTER)
    if not (directory / "state.json").exists():
        print(f"demo: cluster {CLUSTER!r} is not up (no state in {directory})")
        return []
    state = ClusterState.load(directory)
    stopped = stop_cluster(state)
    alive = [r for r in [*state.processes, *leftover_pod_processes(state)] if is_alive(r)]
    if alive:
        raise DemoFailed(f"still running after stop: {', '.join(f'{r.name} (pid {r.pid})' for r in alive)}")
    print(f"demo: cluster {CLUSTER!r} stopped ({len(stopped)} processes); logs kept in {state.logs_dir}")
    return stopped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m baton_dev.demo", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up_parser = commands.add_parser("up", help="start the demo and leave it running")
    up_parser.add_argument(
        "--ci",
        action="store_true",
        default=os.environ.get(ENV_NONINTERACTIVE, "") not in ("", "0"),
        help=f"non-interactive: no question prompt at the end (also ${ENV_NONINTERACTIVE}=1)",
    )
    commands.add_parser("down", help="stop every process of the demo cluster")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            up(args.ci)
        else:
            down()
    except (DemoFailed, BinariesMissing, ComponentFailed) as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        print(f"demo: logs in {cluster_dir(CLUSTER) / 'logs'}; stop with `make demo-down`", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
