"""One level-based reconcile of an InferenceDeployment: build children, apply, read back, status.

Kopf-free, so the same code runs from handlers, from tests and from the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from baton_engine import contract
from baton_operator import metrics, models
from baton_operator.builders import BuildContext, Owner, desired_children, router_endpoint
from baton_operator.builders.common import child_name
from baton_operator.builders.extras import new_signing_key
from baton_operator.events import Event, EventSink
from baton_operator.kube import Kube, KubeError
from baton_operator.models import InferenceDeploymentSpec
from baton_operator.object_cache import ObjectCache, PodIndex, deployment_view, owner_view
from baton_operator.replicas import release, take_over
from baton_operator.resource_status import (
    Failure,
    Observed,
    compute_status,
    status_changed,
    stored_failure,
)
from baton_operator.rollout import controller as rollouts
from baton_operator.workers import ResourceGone, ResourceId


@dataclass(frozen=True)
class OperatorConfig:
    operator_namespace: str = ""
    monitoring_namespace: str = ""


@dataclass
class Outcome:
    applied: int = 0
    events: list[Event] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)


class InvalidSpec(ValueError):
    """The stored spec fails the models (the CRD should have refused it): not retried."""


#: HTTP statuses of a child write that the same write will get again (the spec, or something in
#: the cluster such as an admission policy or a foreign object of that name, must change first).
REFUSED_STATUSES = frozenset({400, 403, 422})


class ChildWriteError(KubeError):
    """A child's write failed; names the child."""

    def __init__(self, manifest: Mapping[str, Any], error: KubeError) -> None:
        self.kind = str(manifest["kind"])
        self.child = str(manifest["metadata"]["name"])
        self.api_message = error.message
        super().__init__(error.status, f"{self.kind} {self.child}: {error.message}", error.reason)

    @property
    def refused(self) -> bool:
        return self.status in REFUSED_STATUSES


def failure_of(exc: BaseException) -> Failure:
    """How Ready and Degraded report a reconcile that stopped with `exc`."""
    if isinstance(exc, ChildWriteError) and exc.refused:
        refusal = f"{exc.reason or 'refused'} (HTTP {exc.status})"
        return Failure("ChildRefused", f"{exc.kind} {exc.child}: {refusal}: {exc.api_message}")
    if isinstance(exc, KubeError):
        return Failure("ReconcileFailed", str(exc))
    return Failure("ReconcileFailed", f"{type(exc).__name__}: {exc}")


#: Called before each child write with its index; tests use it to stop a reconcile part-way.
BeforeWrite = Callable[[int, Mapping[str, Any]], Awaitable[None]]
#: Called before every write made for the resource: raises ResourceGone once it is not the live
#: one (deleted, or another UID took its name), so that nothing is written for a dead UID.
Guard = Callable[[], None]


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def owner_of(body: Mapping[str, Any]) -> Owner:
    meta = body["metadata"]
    return Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def parse_spec(body: Mapping[str, Any]) -> InferenceDeploymentSpec:
    try:
        return InferenceDeploymentSpec.model_validate(body.get("spec", {}))
    except ValidationError as exc:
        raise InvalidSpec(f"spec is invalid: {exc}") from exc


async def _no_hook(index: int, manifest: Mapping[str, Any]) -> None:
    return None


def _no_guard() -> None:
    return None


#: Child writes of one reconcile in flight at once (the API server is shared by every reconcile).
MAX_PARALLEL_WRITES = 4
#: Kinds written only after every other child: a RoleBinding is refused (404, by the RBAC
#: escalation check) until its Role exists; a Deployment's pods need the ServiceAccount and the
#: signing-key Secret.
DEPENDENT_KINDS = frozenset({"RoleBinding", "Deployment"})


@dataclass
class Caches:
    """What the operator has seen of its children and owners (watch events, write answers)."""

    deployments: ObjectCache = field(default_factory=lambda: ObjectCache(deployment_view))
    owners: ObjectCache = field(default_factory=lambda: ObjectCache(owner_view))
    pods: PodIndex = field(default_factory=PodIndex)  # empty without a pod watch: no pod reasons
    #: (namespace, name) -> whether its last look saw a KV-key rollout under way, and the pools'
    #: keys then (absent: not looked yet). While one is, pod changes ask for a reconcile (the
    #: next step); while none is and the keys stay, reconciles need not look.
    rollouts: dict[tuple[str, str], tuple[bool, dict[str, str]]] = field(default_factory=dict)


async def write_in_order(
    manifests: Sequence[Mapping[str, Any]],
    write: Callable[[Mapping[str, Any]], Awaitable[Any]],
    before_write: BeforeWrite,
    first_index: int,
) -> list[Any]:
    """Issue `write` for each manifest in order, at most MAX_PARALLEL_WRITES in flight, awaiting
    `before_write` before each one is issued; the writes' answers, in order.

    If `before_write` or a write fails, nothing more is issued and the writes already issued are
    awaited before the (first) error propagates: a crash after K issues leaves exactly K writes."""
    slots = asyncio.Semaphore(MAX_PARALLEL_WRITES)
    failed: list[BaseException] = []

    async def issued(manifest: Mapping[str, Any]) -> Any:
        try:
            return await write(manifest)
        except Exception as exc:
            failed.append(exc)
            raise
        finally:
            slots.release()

    tasks: list[asyncio.Task[Any]] = []
    try:
        for offset, manifest in enumerate(manifests):
            await before_write(first_index + offset, manifest)
            await slots.acquire()
            if failed:
                slots.release()
                break
            tasks.append(asyncio.create_task(issued(manifest)))
    finally:
        answers = await asyncio.gather(*tasks, return_exceptions=True)
    if failed:
        raise failed[0]
    return answers


async def reconcile(
    kube: Kube,
    body: Mapping[str, Any],
    cfg: OperatorConfig,
    before_write: BeforeWrite = _no_hook,
    caches: Caches | None = None,
    on_event: EventSink | None = None,
    guard: Guard = _no_guard,
) -> Outcome:
    """Bring the children to the spec, then report status. Raises on API errors (status first),
    and ResourceGone, writing nothing more, once `guard` says the resource is not the live one
    or the API no longer has it. Events go to `on_event` as they happen, and into the outcome.

    Independent children go first, several at once (the signing key, the ServiceAccount, the
    Role, Services, policies), then those that need them (DEPENDENT_KINDS)."""
    caches = caches if caches is not None else Caches()
    caches.owners.observe(body)
    owner = owner_of(body)
    generation = int(body["metadata"].get("generation", 0))
    ctx = BuildContext(owner, parse_spec(body), cfg.operator_namespace, cfg.monitoring_namespace)
    signing_key = new_signing_key()
    rollout: rollouts.Pass | None = None
    if ctx.spec.mode == "disaggregated":
        # A KV-compatibility key change is rolled out as two generations (see `rollout`): the
        # pool Deployments are built with this pass's paused flag and replicas.
        seen = caches.rollouts.get((owner.namespace, owner.name))
        if seen is None or seen[0] or seen[1] != rollouts.keys_of(ctx):
            deployments = await _deployments(kube, caches, owner, ctx.spec)
            rollout = await rollouts.begin(kube, ctx, deployments, guard)
            caches.rollouts[(owner.namespace, owner.name)] = (rollout.plan.active, rollout.keys)
    children = desired_children(rollout.context if rollout else ctx, signing_key)
    dependent = [m for m in children.applied if m["kind"] in DEPENDENT_KINDS]
    independent = [m for m in children.applied if m["kind"] not in DEPENDENT_KINDS]
    outcome = Outcome()

    def emit(event: Event) -> None:
        outcome.events.append(event)
        if on_event is not None:
            on_event(event)

    async def create_once(manifest: Mapping[str, Any]) -> None:
        for attempt in (1, 2):
            if await kube.create_if_absent(manifest):
                name = manifest["metadata"]["name"]
                emit(Event("Normal", "SigningKeyCreated", f"created Secret {name}"))
                return
            # It exists, maybe left by an earlier resource of this name (deleted and re-created):
            # adopted, so that the garbage collector keeps it and running pods keep their key.
            guard()
            try:
                await kube.set_owner(manifest)
                return
            except KubeError as exc:
                if exc.status != 404 or attempt == 2:
                    raise
                # The garbage collector deleted it in between: create it after all.

    mode = ctx.spec.autoscaling.mode
    pools = {child_name(owner, role) for role in ctx.spec.roles()}

    async def apply(manifest: Mapping[str, Any]) -> Any:
        # Only the Deployments' answers are read (their status feeds the status computation).
        # A pool's replicas change owner with the autoscaling mode: see `replicas`.
        pool = manifest["kind"] == "Deployment" and manifest["metadata"]["name"] in pools
        if pool:
            await take_over(kube, caches.deployments, manifest, mode, guard)
        result = await kube.apply(manifest, answer=manifest["kind"] == "Deployment")
        outcome.applied += 1
        return await release(kube, caches.deployments, result, mode, guard) if pool else result

    created_once = {id(m) for m in children.created_once}

    async def write(manifest: Mapping[str, Any]) -> Any:
        guard()
        try:
            return await (create_once(manifest) if id(manifest) in created_once else apply(manifest))
        except KubeError as exc:
            raise ChildWriteError(manifest, exc) from exc

    async def guarded(index: int, manifest: Mapping[str, Any]) -> None:
        guard()
        await before_write(index, manifest)

    try:
        first = [*children.created_once, *independent]
        await write_in_order(first, write, guarded, 0)
        for result in await write_in_order(dependent, write, guarded, len(first)):
            if result:
                caches.deployments.observe(result)
        if rollout is not None and rollout.plan.switching:
            # The pools took the new template paused: release their old generation, then let
            # them go on with the rollout's first step.
            emit(Event("Normal", "RollingOut", rollout.plan.message))
            rollout = await rollouts.switch(
                kube, ctx, rollout, await _deployments(kube, caches, owner, ctx.spec), guard
            )
            resumed = [
                m
                for m in desired_children(rollout.context, signing_key).applied
                if m["kind"] == "Deployment" and m["metadata"]["name"] in pools
            ]
            for result in await write_in_order(resumed, write, guarded, len(first) + len(dependent)):
                if result:
                    caches.deployments.observe(result)
        if rollout is not None and rollout.finished:
            emit(Event("Normal", "RolloutComplete", rollout.plan.message))
        for crd_name, manifest in children.optional:
            if await kube.crd_exists(crd_name) and await _apply_optional(kube, crd_name, manifest, guard):
                outcome.applied += 1
        for api_version, kind, name in children.removed:
            guard()
            if await kube.delete_if_present(api_version, kind, owner.namespace, name):
                emit(Event("Normal", "ChildRemoved", f"deleted {kind} {name}"))
    except ResourceGone:
        raise
    except Exception as exc:
        # Report Degraded if the API still answers; the original error is what propagates.
        with contextlib.suppress(KubeError, ResourceGone):
            failure = failure_of(exc)
            outcome.status = await _report(kube, caches, owner, ctx.spec, generation, failure, guard)
        raise
    outcome.status = await _report(kube, caches, owner, ctx.spec, generation, None, guard)
    return outcome


async def _apply_optional(kube: Kube, crd_name: str, manifest: Mapping[str, Any], guard: Guard) -> bool:
    """Apply a child whose CRD was seen installed; False when the API no longer serves its kind
    (the CRD was deleted after it was looked up): an absent optional CRD never fails a reconcile."""
    guard()
    try:
        await kube.apply(manifest, answer=False)
    except KubeError as exc:
        if exc.status != 404:
            raise ChildWriteError(manifest, exc) from exc
        kube.forget_crd(crd_name)
        return False
    return True


async def _deployments(
    kube: Kube, caches: Caches, owner: Owner, spec: InferenceDeploymentSpec
) -> dict[str, Mapping[str, Any] | None]:
    """The child Deployments by role: from the cache, read (and cached) only when never seen."""
    found: dict[str, Mapping[str, Any] | None] = {}
    for role in [*spec.roles(), contract.ROLE_ROUTER]:
        name = child_name(owner, role)
        cached = caches.deployments.get(owner.namespace, name)
        if cached is None:
            cached = await kube.get("apps/v1", "Deployment", owner.namespace, name)
            if cached is not None:
                caches.deployments.observe(cached)
        found[role] = cached
    return found


def _scales_to_zero(spec: InferenceDeploymentSpec) -> bool:
    """Whether the built-in autoscaler may take every pool to zero pods (their minReplicas 0)."""
    auto = spec.autoscaling
    return auto.mode == "builtin" and auto.decode.min_replicas == 0


def _pool_keys(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, str]:
    """The KV-compatibility key of each pool whose generations status shows (disaggregated)."""
    return rollouts.keys_of(BuildContext(owner, spec)) if spec.mode == "disaggregated" else {}


async def _report(
    kube: Kube,
    caches: Caches,
    owner: Owner,
    spec: InferenceDeploymentSpec,
    generation: int,
    failure: Failure | None,
    guard: Guard,
) -> dict[str, Any]:
    """A reconcile's status: observedGeneration (the applied `generation`) when it succeeded."""
    stored = caches.owners.get(owner.namespace, owner.name) or {}
    patch = compute_status(
        name=owner.name,
        generation=generation,
        observed=Observed(
            deployments=await _deployments(kube, caches, owner, spec),
            failure=failure,
            pods=caches.pods.of(owner.namespace, owner.name),
            keys=_pool_keys(owner, spec),
            scale_to_zero=_scales_to_zero(spec),
        ),
        endpoint=router_endpoint(BuildContext(owner, spec)),
        now=now_rfc3339(),
        previous=stored.get("status") or {},
    )
    guard()
    await write_status(kube, caches, owner, patch)
    return patch


async def write_status(kube: Kube, caches: Caches, owner: Owner, patch: Mapping[str, Any]) -> bool:
    """Merge-patch the status subresource unless that would change nothing; True when written.
    Raises ResourceGone when the resource is gone, or the name now holds another one (the status
    subresource ignores metadata, so a UID cannot be a precondition of the patch: the answer's
    UID is checked instead, and the other resource's next status write corrects its status)."""
    stored = caches.owners.get(owner.namespace, owner.name) or {}
    if not status_changed(stored.get("status") or {}, patch):
        metrics.STATUS_PATCHES.labels("unchanged").inc()
        return False
    gone = ResourceGone(ResourceId(owner.namespace, owner.name, owner.uid))
    try:
        answer = await kube.patch_status(owner.namespace, owner.name, patch)
    except KubeError as exc:
        if exc.status == 404:
            raise gone from exc
        raise
    metrics.STATUS_PATCHES.labels("written").inc()
    caches.owners.observe(answer)
    if answer.get("metadata", {}).get("uid") != owner.uid:
        raise gone
    return True


async def refresh_status(kube: Kube, caches: Caches, namespace: str, name: str) -> None:
    """A child changed: recompute the owner's status from the caches (no applies, no
    observedGeneration; a failed reconcile's error stays until a reconcile succeeds)."""
    body = caches.owners.get(namespace, name)
    if body is None:
        body = await kube.get(models.API_VERSION, models.KIND, namespace, name)
        if body is None:
            return  # deleted; garbage collection removes the children
        caches.owners.observe(body)
    try:
        spec = parse_spec(body)
    except InvalidSpec:
        return
    owner = owner_of(body)
    stored = body.get("status") or {}
    deployments = await _deployments(kube, caches, owner, spec)
    patch = compute_status(
        name=name,
        generation=int(stored.get("observedGeneration", body["metadata"].get("generation", 0))),
        observed=Observed(
            deployments=deployments,
            failure=stored_failure(stored),
            pods=caches.pods.of(namespace, name),
            keys=_pool_keys(owner, spec),
            scale_to_zero=_scales_to_zero(spec),
        ),
        endpoint=router_endpoint(BuildContext(owner, spec)),
        now=now_rfc3339(),
        previous=stored,
        record_generation=False,
    )
    with contextlib.suppress(ResourceGone):  # deleted meanwhile: nothing to report
        await write_status(kube, caches, owner, patch)
