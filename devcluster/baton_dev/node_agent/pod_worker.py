"""One pod on a process node, from binding to removal: service-account kubeconfig, processes with
restart back-off, probes, status, and graceful termination (SIGTERM, grace period, SIGKILL)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

from baton_dev.kubeapi import ApiError, JsonObject
from baton_dev.node_agent.container import ContainerRuntime
from baton_dev.node_agent.context import HOST_IP, AgentContext, base_environment, node_resources, now_rfc3339
from baton_dev.node_agent.env import ConfigError, container_env, expand, object_getter
from baton_dev.node_agent.pod_status import PodStatusWriter
from baton_dev.node_agent.probes import ProbeTiming, run_probe
from baton_dev.node_agent.service_account import mint_token, service_account_name, write_credentials

TOKEN_REFRESH_S = 3600


class StartError(RuntimeError):
    pass


async def _wait_event(event: asyncio.Event, timeout: float) -> bool:
    """True if `event` was set within `timeout` seconds."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except TimeoutError:
        return False


class PodWorker:
    def __init__(self, ctx: AgentContext, node: str, pod: JsonObject, ip: str) -> None:
        self.ctx = ctx
        self.node = node
        self.pod = pod
        self.ip = ip
        meta = pod["metadata"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        self.uid: str = meta["uid"]
        self.dir = ctx.pods_dir / f"{meta['namespace']}_{meta['name']}_{self.uid[:8]}"
        self.init_containers = [ContainerRuntime(spec=c) for c in pod["spec"].get("initContainers") or []]
        self.init_failed = False
        self.containers = [ContainerRuntime(spec=c) for c in pod["spec"]["containers"]]
        if self.init_containers:
            for c in self.containers:
                c.state = {"waiting": {"reason": "PodInitializing"}}
        self.terminating = asyncio.Event()
        self.gone = False  # the API object is already deleted: nothing to report or delete
        self._status = PodStatusWriter(ip)
        self._dirty = asyncio.Event()
        self._kubeconfig: Path | None = None

    # --- events from the pod watch -------------------------------------------------------------
    def update(self, pod: JsonObject) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.terminating.set()

    def deleted(self) -> None:
        self.gone = True
        self.terminating.set()

    # --- main ----------------------------------------------------------------------------------
    async def run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        publisher = asyncio.create_task(self._publish_loop())
        loops: list[asyncio.Task[None]] = []
        try:
            self._mark_dirty()
            if await self._service_account_access() and await self._run_init_containers():
                loops = [asyncio.create_task(self._container_loop(c)) for c in self.containers]
            while not await _wait_event(self.terminating, TOKEN_REFRESH_S):
                await self._service_account_access()
            await self._terminate(self._grace_period())
            await asyncio.gather(*loops, return_exceptions=True)
            await self._publish_now()
            await self._remove_from_api()
        finally:
            for task in [*loops, publisher]:
                task.cancel()
            await asyncio.gather(*loops, publisher, return_exceptions=True)
            await self._kill_all(grace=0.0)
            shutil.rmtree(self.dir / "serviceaccount", ignore_errors=True)

    async def shutdown(self, grace_cap: float) -> None:
        """The agent is stopping: end the processes (not the pod object)."""
        self.gone = True
        await self._kill_all(grace=min(self._grace_period(), grace_cap))

    def _grace_period(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", 30)
        return float(grace)

    # --- service-account token -----------------------------------------------------------------
    async def _service_account_access(self) -> bool:
        """Mint a bound token and write it as a kubeconfig; retries until it works or the pod is
        deleted. False if the pod went away first."""
        if self.pod["spec"].get("automountServiceAccountToken") is False:
            return True
        while not self.terminating.is_set():
            try:
                token = await mint_token(self.ctx.api, self.pod)
            except Exception as e:  # ApiError or transport: report and retry
                message = f"cannot mint a token for service account {service_account_name(self.pod)!r}: {e}"
                for c in self.containers:
                    c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": message}}
                self._mark_dirty()
                await _wait_event(self.terminating, 2.0)
                continue
            self._kubeconfig = write_credentials(
                self.dir / "serviceaccount", self.ctx.access, self.pod, token
            )
            return True
        return False

    def _base_env(self) -> dict[str, str]:
        env = base_environment(self.ctx.venv_bin)
        server = self.ctx.access.server.removeprefix("https://")
        host, _, port = server.rpartition(":")
        env.update(
            HOSTNAME=self.pod["metadata"]["name"],
            KUBERNETES_SERVICE_HOST=host,
            KUBERNETES_SERVICE_PORT=port,
            KUBERNETES_SERVICE_PORT_HTTPS=port,
        )
        if self._kubeconfig is not None:
            env["KUBECONFIG"] = str(self._kubeconfig)
        return env

    # --- one container -------------------------------------------------------------------------
    async def _container_loop(self, c: ContainerRuntime) -> None:
        """Run a container, restarting it as restartPolicy says, until the pod terminates."""
        policy = self.pod["spec"].get("restartPolicy", "Always")
        backoff: float | None = None  # like the kubelet: the first restart is immediate
        while not self.terminating.is_set():
            started = time.monotonic()
            returncode = await self._run_once(c)
            if returncode is None or self.terminating.is_set():
                continue
            if not (policy == "Always" or (policy == "OnFailure" and returncode != 0)):
                c.final = True
                self._mark_dirty()
                return
            backoff = await self._back_off(c, backoff, started)

    async def _run_init_containers(self) -> bool:
        """Each init container to completion, in order; a failed one is retried with back-off
        unless restartPolicy is Never (then the pod fails). True once all have succeeded."""
        never = self.pod["spec"].get("restartPolicy", "Always") == "Never"
        for c in self.init_containers:
            backoff: float | None = None
            while not self.terminating.is_set():
                started = time.monotonic()
                returncode = await self._run_once(c)
                if returncode is None or self.terminating.is_set():
                    continue
                if returncode == 0 or never:
                    c.final = True
                    self.init_failed = returncode != 0
                    self._mark_dirty()
                    break
                backoff = await self._back_off(c, backoff, started)
            if not c.final or self.init_failed:
                return False
        return True

    async def _run_once(self, c: ContainerRuntime) -> int | None:
        """Start the container and wait for its exit code; None if its env cannot be built yet
        (reported as CreateContainerConfigError and retried after a pause)."""
        try:
            c.env = await container_env(
                self.pod,
                c.spec,
                self._base_env(),
                object_getter(self.ctx.api, self.pod["metadata"]["namespace"]),
                self.ip,
                HOST_IP,
                node_resources(self.ctx.gpus),
            )
        except ConfigError as e:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            self._mark_dirty()
            await _wait_event(self.terminating, 2.0)
            return None
        try:
            await self._start(c)
            return await self._supervise(c)
        except StartError as e:
            c.state = {
                "terminated": {
                    "exitCode": 128,
                    "reason": "StartError",
                    "message": str(e),
                    "finishedAt": now_rfc3339(),
                }
            }
            self.ctx.kube_event(self.pod, self.node, "Failed", str(e), c.name, warning=True)
            return 128

    async def _back_off(self, c: ContainerRuntime, backoff: float | None, started: float) -> float | None:
        """Wait before restarting `c` (0, then initial, doubling up to the cap; reset after a long
        run) and count the restart. Returns the next back-off."""
        if time.monotonic() - started > 2 * self.ctx.backoff_max_s:
            backoff = None
        delay = 0.0 if backoff is None else backoff
        backoff = self.ctx.backoff_initial_s if backoff is None else min(2 * backoff, self.ctx.backoff_max_s)
        c.last_state = c.state
        c.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:g}s restarting failed container={c.name} pod={self.key}",
            }
        }
        self._mark_dirty()
        self.ctx.record("restart-scheduled", pod=self.key, uid=self.uid, container=c.name, delay_s=delay)
        if delay:
            self.ctx.kube_event(
                self.pod, self.node, "BackOff", "Back-off restarting failed container", c.name, warning=True
            )
        if not await _wait_event(self.terminating, delay):
            c.restart_count += 1
        return backoff

    def _argv(self, c: ContainerRuntime) -> list[str]:
        argv = [expand(a, c.env) for a in (c.spec.get("command") or []) + (c.spec.get("args") or [])]
        if not argv:
            raise StartError(
                f"container {c.name!r} has no command: process nodes ignore images, "
                "so the pod must give command (and args)"
            )
        if "/" not in argv[0]:
            found = shutil.which(argv[0], path=c.env.get("PATH"))
            if found is None:
                raise StartError(f"executable {argv[0]!r} not found in PATH={c.env.get('PATH')}")
            argv[0] = found
        return argv

    async def _start(self, c: ContainerRuntime) -> None:
        argv = self._argv(c)
        workdir = c.spec.get("workingDir")
        cwd = workdir if workdir and os.path.isdir(workdir) else str(self.dir)
        with open(self.dir / f"{c.name}.log", "ab") as log:
            try:
                c.proc = await asyncio.create_subprocess_exec(
                    *argv,
                    cwd=cwd,
                    env=c.env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                raise StartError(f"cannot start {argv[0]}: {e}") from e
        self.ctx.track_pid(c.proc.pid)
        c.ever_started = True
        c.started = "startupProbe" not in c.spec
        c.ready = c.started and "readinessProbe" not in c.spec
        c.state = {"running": {"startedAt": now_rfc3339()}}
        self._mark_dirty()
        self.ctx.record(
            "started",
            pod=self.key,
            uid=self.uid,
            container=c.name,
            pid=c.proc.pid,
            restart_count=c.restart_count,
        )
        self.ctx.kube_event(self.pod, self.node, "Started", f"Started container {c.name}", c.name)

    async def _supervise(self, c: ContainerRuntime) -> int:
        """Run the probes until the process exits; return its exit code."""
        assert c.proc is not None
        proc = c.proc
        probes = asyncio.create_task(self._probe(c, proc))
        returncode = await proc.wait()
        # Like a container's cgroup, the process group does not outlive its main process.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        probes.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probes
        self.ctx.untrack_pid(proc.pid)
        started_at = c.state.get("running", {}).get("startedAt", "")
        terminated: JsonObject = {
            "exitCode": returncode if returncode >= 0 else 128 - returncode,
            "reason": "Completed" if returncode == 0 else "Error",
            "startedAt": started_at,
            "finishedAt": now_rfc3339(),
            "containerID": f"baton-process://{proc.pid}",
        }
        if returncode < 0:
            terminated["signal"] = -returncode
        c.state = {"terminated": terminated}
        c.ready = False
        self._mark_dirty()
        self.ctx.record(
            "exited", pod=self.key, uid=self.uid, container=c.name, pid=proc.pid, returncode=returncode
        )
        return returncode

    # --- probes --------------------------------------------------------------------------------
    async def _probe(self, c: ContainerRuntime, proc: asyncio.subprocess.Process) -> None:
        startup = c.spec.get("startupProbe")
        if startup is not None:
            if not await self._until_threshold(c, startup, "Startup"):
                await self._kill_for_probe(c, proc, startup, "Startup")
                return
            c.started = True
            c.ready = "readinessProbe" not in c.spec
            self._mark_dirty()
        await asyncio.gather(self._readiness(c), self._liveness(c, proc))

    async def _until_threshold(self, c: ContainerRuntime, probe: JsonObject, kind: str) -> bool:
        """Probe until success (True) or failureThreshold consecutive failures (False)."""
        timing = ProbeTiming.of(probe)
        await asyncio.sleep(timing.initial_delay_s)
        failures = 0
        while True:
            ok, message = await run_probe(probe, c.spec, self.ip, c.env, str(self.dir))
            if ok:
                return True
            failures += 1
            self._probe_failed(c, kind, message)
            if failures >= timing.failure_threshold:
                return False
            await asyncio.sleep(timing.period_s)

    async def _readiness(self, c: ContainerRuntime) -> None:
        probe = c.spec.get("readinessProbe")
        if probe is None:
            return
        timing = ProbeTiming.of(probe)
        await asyncio.sleep(timing.initial_delay_s)
        successes = failures = 0
        while True:
            ok, message = await run_probe(probe, c.spec, self.ip, c.env, str(self.dir))
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if not ok:
                self._probe_failed(c, "Readiness", message)
            ready = successes >= timing.success_threshold or (c.ready and failures < timing.failure_threshold)
            if ready != c.ready:
                c.ready = ready
                self._mark_dirty()
                self.ctx.record("readiness", pod=self.key, uid=self.uid, container=c.name, ready=ready)
            await asyncio.sleep(timing.period_s)

    async def _liveness(self, c: ContainerRuntime, proc: asyncio.subprocess.Process) -> None:
        probe = c.spec.get("livenessProbe")
        if probe is None:
            return
        timing = ProbeTiming.of(probe)
        await asyncio.sleep(timing.initial_delay_s)
        failures = 0
        while True:
            ok, message = await run_probe(probe, c.spec, self.ip, c.env, str(self.dir))
            failures = 0 if ok else failures + 1
            if not ok:
                self._probe_failed(c, "Liveness", message)
            if failures >= timing.failure_threshold:
                await self._kill_for_probe(c, proc, probe, "Liveness")
                return
            await asyncio.sleep(timing.period_s)

    def _probe_failed(self, c: ContainerRuntime, kind: str, message: str) -> None:
        self.ctx.record(
            "probe-failed", pod=self.key, uid=self.uid, container=c.name, probe=kind, message=message
        )
        self.ctx.kube_event(self.pod, self.node, "Unhealthy", f"{kind} probe failed: {message}", c.name, True)

    async def _kill_for_probe(
        self, c: ContainerRuntime, proc: asyncio.subprocess.Process, probe: JsonObject, kind: str
    ) -> None:
        grace = probe.get("terminationGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        self.ctx.kube_event(
            self.pod,
            self.node,
            "Killing",
            f"Container {c.name} failed {kind.lower()} probe, will be restarted",
            c.name,
        )
        # Shielded: the probe task is cancelled when the process exits, mid-kill.
        await asyncio.shield(self._kill(c, proc, float(grace)))

    # --- termination ---------------------------------------------------------------------------
    async def _kill(self, c: ContainerRuntime, proc: asyncio.subprocess.Process, grace: float) -> None:
        """SIGTERM the container's process group, SIGKILL after `grace` seconds."""
        if proc.returncode is not None:
            return
        # Recorded just before each signal is sent, so the record's time precedes its delivery.
        self.ctx.record("sigterm", pod=self.key, uid=self.uid, container=c.name, pid=proc.pid, grace_s=grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), grace)
            return
        except TimeoutError:
            pass
        self.ctx.record("sigkill", pod=self.key, uid=self.uid, container=c.name, pid=proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()

    async def _kill_all(self, grace: float) -> None:
        running = [
            (c, c.proc)
            for c in self.init_containers + self.containers
            if c.proc is not None and c.proc.returncode is None
        ]
        await asyncio.gather(*(self._kill(c, p, grace) for c, p in running if p is not None))
        for _, p in running:
            if p is not None:
                self.ctx.untrack_pid(p.pid)

    async def _terminate(self, grace: float) -> None:
        names = ", ".join(c.name for c in self.containers if c.running)
        if names:
            self.ctx.kube_event(self.pod, self.node, "Killing", f"Stopping container {names}")
        await self._kill_all(grace)

    async def _remove_from_api(self) -> None:
        """The kubelet's final step: delete with grace 0, only this incarnation (uid precondition)."""
        if self.gone:
            return
        meta = self.pod["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": self.uid},
        }
        try:
            await self.ctx.api.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body)
        except ApiError as e:
            if e.status not in (404, 409):
                raise
        self.ctx.record("removed", pod=self.key, uid=self.uid)

    # --- status --------------------------------------------------------------------------------
    def _mark_dirty(self) -> None:
        self._dirty.set()

    async def _publish_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._publish_now()
            except ApiError as e:
                if e.status == 404:
                    return
                self._dirty.set()
                await asyncio.sleep(1.0)
            except Exception:  # transport errors: retry, the API server may be restarting
                self._dirty.set()
                await asyncio.sleep(1.0)

    async def _publish_now(self) -> None:
        if self.gone:
            return
        meta = self.pod["metadata"]
        try:
            await self.ctx.api.patch(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                {"status": self.status()},
            )
        except ApiError as e:
            if e.status != 404:
                raise

    def status(self) -> JsonObject:
        return self._status.status(self.pod, self.init_containers, self.containers, self.init_failed)
